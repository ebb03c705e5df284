"""The optimizer on a pipeline's stages, exactly as on one device: stacked stage blocks seen as
parts of their whole leaves (`blocks`), and the packed stages of ``rp.pipeline.sequential``
updated leaf by leaf (`transform`: the program of ``tx.update`` placed stage by stage in
`program`, run in `execution`, on ZeRO's parts in `zero_parts`)."""
