"""The data plane: pools per tier kind, copy handlers, attention calls."""
