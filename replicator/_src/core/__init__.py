"""The core: the Binding, the mesh and each leaf's PartitionSpec, the replica collectives, the lowering of one replica's step into one program, its cache, and the notes made while tracing."""
