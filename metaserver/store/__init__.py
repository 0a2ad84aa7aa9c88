"""etcd persistence: ``persist.EtcdStore`` (every etcd call, the fence, dropped-write accounting), ``batcher`` and
``combine`` (commit records written in group commits and combined transactions), ``generations`` (the generation
counter), ``fullload`` (reading a prefix back), ``gcpolicy`` (the garbage-collection pauses). Imports the table's
record format (``metaserver.table.records``) and nothing above it.
"""
