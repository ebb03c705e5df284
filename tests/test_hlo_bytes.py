"""The bytes a TPU program's kernels read and write (`replicator._src.report.hlo_bytes`): an
update in place counts its update, where the compiler fuses it with the matmul that makes it."""

from replicator._src.report import hlo

# a scanned layer's matmul fused with the update that stores its output in the residuals'
# stack, [layers, ...]: a multi-output fusion, the update (through a bitcast) one of its outputs
MODULE = """
%fused (p0: bf16[32,64,128], p1: s32[], p2: bf16[64,256], p3: bf16[256,128]) -> (bf16[32,64,128], bf16[64,128]) {
  %p0 = bf16[32,64,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = bf16[64,256]{1,0} parameter(2)
  %p3 = bf16[256,128]{1,0} parameter(3)
  %d = bf16[64,128]{1,0} dot(%p2, %p3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %b = bf16[1,64,128]{2,1,0} bitcast(%d)
  %z = s32[] constant(0)
  %u = bf16[32,64,128]{2,1,0} dynamic-update-slice(%p0, %b, %p1, %z, %z)
  %ub = bf16[32,64,128]{2,1,0} bitcast(%u)
  ROOT %t = (bf16[32,64,128]{2,1,0}, bf16[64,128]{1,0}) tuple(%ub, %d)
}

ENTRY %main (stack: bf16[32,64,128], i: s32[], x: bf16[64,256], w: bf16[256,128]) -> (bf16[32,64,128], bf16[64,128]) {
  %stack = bf16[32,64,128]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = bf16[64,256]{1,0} parameter(2)
  %w = bf16[256,128]{1,0} parameter(3)
  ROOT %f = (bf16[32,64,128]{2,1,0}, bf16[64,128]{1,0}) fusion(%stack, %i, %x, %w), kind=kOutput, calls=%fused
}
"""


def test_a_matmul_fused_with_its_store_into_a_stack_counts_the_update_not_the_stack():
    costs = hlo.analyze(MODULE, {"data": 1})
    product, x, w = 64 * 128 * 2, 64 * 256 * 2, 256 * 128 * 2
    # the product written twice (into the stack, in place, and as the second output), the
    # operands read, the index: not the 32-layer stack (32 x the product) read and written
    assert costs.bytes_accessed == 2 * product + x + w + 4
    assert costs.flops == 2 * 64 * 128 * 256
