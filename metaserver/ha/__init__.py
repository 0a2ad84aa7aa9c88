"""Slots and high availability: ``service.Metaserver`` (one slot's state and handlers), ``election`` (the process
lease, campaigns, fencing on the slot key's revision: ``fence``), ``slots`` and ``partition`` (a pool is always
slots, one by default; ``partanswers``/``multislot`` answer requests that span them), ``standby``/``warmrows``/
``warmpace`` (warm copies a standby keeps), ``handoff`` (a clean hand-over), ``supervise`` (loops that must not
die quietly). Sits on the handlers, the store and the table; ``metaserver.server`` sits on it.
"""
