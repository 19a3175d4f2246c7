"""Running code the zoo does not own: loading a plug-in by its import path (``plugins``), bounding each call of it in
time (``call_limit``), and ending what it leaves running when a command is done (``leftovers``). The ground floor of
the zoo: used by its parts, its command line and the spec suite alike."""
