"""Starting the real tritonserver (shipped inside the PyPI package nvidia-pytriton)."""
