"""Tools run from a checkout, outside the installed package."""
