"""A capture node on another host: ``engine=remote`` (online training's features over a transfer engine).

Where the target is served on other machines than the trainer (Kimi-K2.5: a TP8 serving
node, a training node), the capture node runs the target and answers capture requests;
the tensors travel through Mooncake's store (``mooncake-transfer-engine``, its non-CUDA
build on CPU; TCP or RDMA), written and read with hs-connectors'
``MooncakeHiddenStatesStore``, the transport speculators' online training uses; only token
ids and the small transfer manifests (shapes, dtypes, byte offsets) go over HTTP.

* :mod:`eagle3.engines.remote.transfer`: a capture as one packed Mooncake object and back.
* :mod:`eagle3.engines.remote.server`: the capture node (``python -m eagle3.engines.remote``).
* :mod:`eagle3.engines.remote.engine`: the trainer's side, an :class:`~eagle3.engines.Engine`
  whose ``capture`` asks the node and reads the store.
"""
