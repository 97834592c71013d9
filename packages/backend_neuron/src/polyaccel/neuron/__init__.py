"""polyaccel AWS Trainium2 backend.

Importing this package does no work and imports nothing heavy; the backend object lives in
:mod:`polyaccel.neuron.plugin` and is found through the ``polyaccel.backends`` entry point.

Modules: ``plugin`` (the backend), ``kernels`` (NKI kernels + torch wrappers), ``sim`` (our
NumPy NKI interpreter), ``nki_api`` (real NKI or the interpreter), ``compile`` (TorchNeuron
-> NEFF), ``nrt`` (libnrt via ctypes), ``runtime`` (one replica per NeuronCore, DP8).
See docs/neuron.md.
"""
