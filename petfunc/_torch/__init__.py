"""petfunc._torch."""
