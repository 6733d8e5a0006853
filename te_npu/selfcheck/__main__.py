"""``python -m te_npu.selfcheck``: see ``te_npu.selfcheck.run``."""
import sys

from te_npu.selfcheck.run import main

sys.exit(main())
