"""The step: one pass of the model over this rank's chunks, and the hooks that run unchanged PyG layers on a chunk.

``pipeline.py``   the pipelined pass: fill, drain, the exact pass, history preparation
``stream.py``     NGra streaming on one device: layer group by layer group over all chunks, exact
``barriers.py``   the halo of a streamed chunk: barrier sites
``chunk.py``      one chunk forward and backward (shared by every pass), the output on every rank
``checks.py``     what a pass checks of the model on a cut graph (rows combined outside layers, the output)
``layers.py``     the hooks around every ``MessagePassing`` call
``arguments.py``  a layer call's graphs, node and edge tensors on a chunk
``degrees.py``    ``gcn_norm`` / ``get_laplacian`` with the whole graph's degrees
``norms.py``      graph-wide norms (BatchNorm, GraphNorm, ...) run with every way's rows
``rows.py``       operations combining vertex rows outside layers: found, refused
"""
