"""`qwenserve plan`: will a model fit, on which devices, with which flags."""

from qwenserve.tools.plan.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
