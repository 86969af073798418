"""Adapters for real engines; each imports its engine library only when used."""
