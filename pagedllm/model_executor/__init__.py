"""Models, their layers, and the loaders that fill them with checkpoint weights."""
