"""fxfuse's built-in graph passes, one per module (installed as ``fxfuse.passes``).

Each module registers its pass with :func:`fxfuse.register_pass`. Importing this package imports every module
and checks the registry (see :func:`fxfuse.registry.load_pass_package`): a module that fails to import or
registers nothing is a :class:`~fxfuse.errors.PassRegistrationError` here, at import.
"""
from fxfuse.registry import load_pass_package

PASSES = load_pass_package(__name__)
