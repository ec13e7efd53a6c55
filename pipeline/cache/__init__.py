"""The cache stage's room: the target cache's format (``format.py``: schema, decoding, manifest),
the shard writer (``writer.py``: local or S3), how conversations are cut into shards
(``shards.py``), the stage itself (``stage.py``: Ray Data forward actors) and the check that the
cached final state reproduces the target's logits (``check.py``)."""
