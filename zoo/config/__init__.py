"""Configuration: the option lists, the structured schema and its checks, and the builder from config to model
(plug-in loading by import path is zoo/runtime/plugins.py, below zoo.nn)."""
