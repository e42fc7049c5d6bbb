"""Fails the ordinary way: a traceback nobody's rules know, exit 1."""

raise ValueError("the widget count must be even (got 3)")
