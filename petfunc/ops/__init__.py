"""petfunc.ops."""
