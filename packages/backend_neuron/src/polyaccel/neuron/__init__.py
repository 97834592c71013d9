"""polyaccel AWS Trainium2 backend.

Importing this package does no work and imports nothing heavy; the backend object lives in
:mod:`polyaccel.neuron.plugin` and is found through the ``polyaccel.backends`` entry point.
"""
