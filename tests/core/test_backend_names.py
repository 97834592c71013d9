"""An unknown backend name (``--backend gpu``) gets a did-you-mean and never an invented
package name to ``pip install`` (a guessed name could be anyone's on PyPI)."""

from __future__ import annotations

import re

import pytest

from polyaccel.core import select_backend
from polyaccel.core.plugins import backends, unknown_backend_message

KNOWN = ["cuda", "neuron", "cpu"]


@pytest.mark.parametrize("name, guess", [
    ("gpu", "cuda"), ("GPU", "cuda"), ("nvidia", "cuda"), ("cdua", "cuda"), ("CUDA", "cuda"),
    ("trainium", "neuron"), ("trn", "neuron"), ("trn2", "neuron"), ("nuron", "neuron"), ("cpuu", "cpu"),
])
def test_unknown_backend_names_get_a_did_you_mean(name, guess):
    message = unknown_backend_message(name, KNOWN)
    assert message.startswith(f"unknown backend {name!r} (did you mean {guess!r}?); known: cuda, neuron, cpu")


@pytest.mark.parametrize("name", ["tpu", "mps", "xyz"])
def test_no_guess_for_names_that_are_nothing_like_a_backend(name):
    assert "did you mean" not in unknown_backend_message(name, KNOWN)


def test_an_alias_of_a_backend_that_is_not_installed_says_so():
    assert "(did you mean 'cuda'?; it is not installed here)" in unknown_backend_message("gpu", ["cpu"])


@pytest.mark.parametrize("name", ["gpu", "tpu", "trainium"])
def test_select_backend_names_no_package_to_install(name):
    with pytest.raises(KeyError) as e:
        select_backend(name)
    message = str(e.value)
    assert f"unknown backend {name!r}" in message and "known: " + ", ".join(backends()) in message
    assert "pip install" not in message and not re.search(r"polyaccel-backend-\w", message)
    assert "polyaccel backends" in message
