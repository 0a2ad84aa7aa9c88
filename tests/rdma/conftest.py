"""tests/rdma: the guest-side suite (``guest/``) runs only inside the Soft-RoCE guest (``UMBP_RDMA_GUEST=1``, set
by ``testbed.py``); on the host it is not collected, and ``test_rdma_guest.py`` boots the guest to run it."""

import os

collect_ignore_glob = [] if os.environ.get("UMBP_RDMA_GUEST") else ["guest/*"]
