"""Test-only: on ``PYTHONPATH`` of the tensor-parallel rank processes a test starts, so that
they rig their proposer as the test's own process does (``helpers/spec_decode.py``)."""

import os

if os.environ.get("QWENSERVE_TEST_RIGGED_DRAFTS"):
    from helpers.spec_decode import install_rig_from_env

    install_rig_from_env()
