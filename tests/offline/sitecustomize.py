"""Imported by Python at the start of every process a test starts (this folder is on their PYTHONPATH, see
tests/conftest.py): the network guard, refusing with `network_guard.OffTheMachine`."""

import network_guard

network_guard.install(network_guard.raise_off_the_machine)
