"""KV transfer plane: a prefill node pushes KV, layer by layer, over UCX into blocks that a decode
node reserved. `transfer.protocol`, `transfer.errors` and `transfer.env` are plain Python;
`transfer.ucx` (KvReceiver, KvSender) imports ucxx. This package's __init__ imports nothing so
that the wire format can be used without loading UCX."""
