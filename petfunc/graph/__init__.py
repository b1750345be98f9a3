"""petfunc.graph."""
