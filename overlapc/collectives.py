"""``overlapc.collectives``: the public name of ``overlapc.passes.collectives``.

Recognising collectives, pairing starts and waits and finding barriers is the
passes' ground floor (``passes/collectives.py``); users, the product and the tests
import it under this name. This module puts that same module object in its
place, so both names are one module: an attribute set through one is seen
through the other.
"""
import sys

from overlapc.passes import collectives as _collectives

sys.modules[__name__] = _collectives
