"""The gRPC face of the worker: the servicer, protobuf <-> worker types, wire decoding, pooling, drain."""
