"""The gRPC face of the worker: the servicer, protobuf <-> worker types, prompt rendering, drain."""
