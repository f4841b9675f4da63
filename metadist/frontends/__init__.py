"""Frontends: capture framework programs into MetaIR and execute their ops."""
