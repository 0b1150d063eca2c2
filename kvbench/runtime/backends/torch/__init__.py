"""The torch backend: the plain-torch reference paged attention (`attention`) behind `backend.TorchBackend`."""
