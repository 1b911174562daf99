"""The mitmproxy side: addons that wire proxy hooks to the engine, and how they are run.

``default_addons()`` (in :mod:`proxy.mitm.wiring`) is the one ordered list of addons that
``addons/crosstalk.py``, ``crosstalk run`` and the detector process all load.
"""
