"""Placeholder package of the design layout; filled by its own issue."""
