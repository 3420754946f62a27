"""An example third-party GEM trainer plugin."""
