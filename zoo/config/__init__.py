"""Configuration: the option lists, the structured schema and its checks, the builder from config to
model, and plug-in loading by import path."""
