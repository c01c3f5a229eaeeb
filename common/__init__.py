"""Code shared by router and worker: configuration, generated protobuf code, tracing, metrics."""
