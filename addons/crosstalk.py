"""crosstalk as a mitmproxy script: ``mitmdump -s addons/crosstalk.py --mode reverse:URL``.

Options are prefixed ``crosstalk_`` (``--set crosstalk_config=PATH``). The logic lives
in the ``proxy`` package; install it first (``pip install -e .`` or ``make test``).
"""

from proxy.mitm.wiring import default_addons

addons = default_addons()
