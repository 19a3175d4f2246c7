# The suite's options and hooks live in an importable plugin (properties/plugin.py) so that pytest can load
# them from anywhere; registering it by module name here means `-p properties.plugin` never adds it twice.
pytest_plugins = ["properties.plugin"]
