/* C API of distemb's CUDA kernels (loaded with ctypes by distemb/kernels/cuda.py).
 *
 * Every pointer is a device pointer unless named *_host. Tables are row-major,
 * contiguous float32; ids are int64. Each entry point makes `device` current, enqueues
 * its work on `stream` (a cudaStream_t, NULL for the legacy default stream) and returns
 * a cudaError_t as int: 0 on success, cudaErrorInvalidValue (1) for bad sizes. Work is
 * asynchronous: errors inside kernels surface on a later call or synchronisation.
 * Semantics are those of distemb/kernels/reference.py; `rows` passed to the updates
 * must be unique (the caller dedups); ids out of range are handled as said below.
 */
#ifndef DISTEMB_CUDA_H_
#define DISTEMB_CUDA_H_

#include <stddef.h>
#include <stdint.h>

#define DISTEMB_API extern "C" __attribute__((visibility("default")))

/* Bumped whenever a signature below changes; the Python loader checks it. */
#define DISTEMB_CUDA_ABI_VERSION 4

DISTEMB_API int distemb_cuda_abi_version(void);
DISTEMB_API const char* distemb_cuda_error_string(int code);
DISTEMB_API int distemb_cuda_device_count(int* count_host);

/* Rows per chunk of dedup_sum's segment sum (see dedup_sum below). */
DISTEMB_API int distemb_cuda_sum_chunk_rows(void);

/* Dedup in phases; the output size (the unique count) is data dependent but never
 * needed on the host in between, so all phases can be enqueued before the caller waits:
 * 1. dedup_workspace_bytes: how much scratch memory a batch of n ids of d columns needs
 *    (allocate it 256-byte aligned, as cudaMalloc and torch's allocator do).
 *    The sort reads bits [0, end_bit) of each id: 64 for any ids, or fewer when every
 *    id is known to lie in [0, 2^end_bit) (fewer radix passes); same n, d, end_bit below.
 * 2. dedup_sort: sorts ids, writes ascending unique ids to uniq (capacity n) and their
 *    number to *num_unique (one device int64), and plans the chunks of the sum.
 *    num_rows > 0 is the table size: ids outside [0, num_rows) are then summed as one
 *    id num_rows (which the updates skip), and uniq[num_unique..n) is filled with
 *    num_rows, so all n slots can go to an update with no count on the host; end_bit
 *    must then cover num_rows itself. num_rows <= 0: ids are taken as they are.
 * 3. dedup_sum: writes the summed gradients of the unique ids to the first num_unique
 *    rows of summed (capacity (n, d)), reusing the workspace that phase 2 filled (keep
 *    it alive and untouched in between). The rows of one id are summed in chunks of
 *    distemb_cuda_sum_chunk_rows() rows in batch order, then the chunks' sums in chunk
 *    order: a fixed order, so results are identical run to run, and balanced however
 *    many rows one id has. */
DISTEMB_API int distemb_cuda_dedup_workspace_bytes(int64_t n, int64_t d, int end_bit,
                                                   size_t* bytes_host, int device);
DISTEMB_API int distemb_cuda_dedup_sort(const int64_t* ids, int64_t n, int64_t d,
                                        int64_t num_rows, int end_bit, void* workspace,
                                        size_t workspace_bytes, int64_t* uniq,
                                        int64_t* num_unique, int device, void* stream);
DISTEMB_API int distemb_cuda_dedup_sum(const float* grads, int64_t n, int64_t d,
                                       void* workspace, size_t workspace_bytes, float* summed,
                                       int device, void* stream);

DISTEMB_API int distemb_cuda_gather_rows(const float* table, int64_t d, const int64_t* rows,
                                         int64_t n, float* out, int device, void* stream);
/* As gather_rows for a table of num_rows rows, but ids outside [0, num_rows) read zeros
 * and are recorded in flags (three device int64: their count, the smallest, the largest;
 * start them at 0, INT64_MAX, INT64_MIN) instead of reading out of bounds. */
DISTEMB_API int distemb_cuda_gather_rows_checked(const float* table, int64_t num_rows,
                                                 int64_t d, const int64_t* rows, int64_t n,
                                                 float* out, int64_t* flags, int device,
                                                 void* stream);

/* The updates take the table's row count: a row outside [0, num_rows) is skipped (ids
 * are validated on the device without stopping the stream, so a bad one can reach an
 * update before the host reports it; it never writes outside the table). */
/* state_sum holds one float per table row. */
DISTEMB_API int distemb_cuda_rowwise_adagrad_update(float* weight, float* state_sum,
                                                    int64_t num_rows, int64_t d,
                                                    const int64_t* rows, const float* grads,
                                                    int64_t n, float clr, float eps,
                                                    int device, void* stream);
/* row_steps NULL: bias correction uses the global `step` (torch.optim.SparseAdam).
 * Otherwise one int64 per table row, incremented here for each updated row, whose own
 * count drives its bias correction (lazy Adam, as DGL). */
DISTEMB_API int distemb_cuda_adam_update(float* weight, float* exp_avg, float* exp_avg_sq,
                                         int64_t num_rows, int64_t d, const int64_t* rows,
                                         const float* grads, int64_t n, double lr, double beta1,
                                         double beta2, double eps, int64_t step,
                                         int64_t* row_steps, int device, void* stream);

/* Half-precision rows: `table`/`weight` hold uint16 bits, `kind` 0 bfloat16, 1 float16,
 * 2 bfloat16 rounded stochastically (updates; the random bits are a hash of `seed`, the
 * row id and the column). Gradients, state, `out` and all maths are float32; each
 * updated value is rounded to nearest-even on store (kind 0 and 1), exactly as the CPU
 * kernels of csrc/cpu_kernels.h. Ids out of range: as the float32 entry points above. */
DISTEMB_API int distemb_cuda_half_gather_rows_checked(const uint16_t* table, int kind,
                                                      int64_t num_rows, int64_t d,
                                                      const int64_t* rows, int64_t n,
                                                      float* out, int64_t* flags,
                                                      int device, void* stream);
DISTEMB_API int distemb_cuda_half_rowwise_adagrad_update(uint16_t* weight, int kind,
                                                         uint64_t seed, float* state_sum,
                                                         int64_t num_rows, int64_t d,
                                                         const int64_t* rows,
                                                         const float* grads, int64_t n,
                                                         float clr, float eps, int device,
                                                         void* stream);
DISTEMB_API int distemb_cuda_half_adam_update(uint16_t* weight, int kind, uint64_t seed,
                                              float* exp_avg, float* exp_avg_sq,
                                              int64_t num_rows, int64_t d, const int64_t* rows,
                                              const float* grads, int64_t n, double lr,
                                              double beta1, double beta2, double eps,
                                              int64_t step, int64_t* row_steps, int device,
                                              void* stream);

/* The element-wise rules (SGD, Adagrad, FTRL, ...: csrc/rules.h), float32 and half rows:
 *   distemb_cuda_<rule>_update(float* weight, <float* state>..., int64_t num_rows,
 *       int64_t d, const int64_t* rows, const float* grads, int64_t n, <hyperparameters>,
 *       int device, void* stream)
 *   distemb_cuda_half_<rule>_update(uint16_t* weight, int kind, uint64_t seed, <as above>)
 * with each rule's states ((R, D) float32) and hyperparameters as distemb/kernels/
 * rule_table.py lists them; declared in csrc/gen/cuda_rules.h, generated from that table
 * by csrc/codegen.py (setup.py runs it). A hyperparameter the table marks positive is
 * refused (cudaErrorInvalidValue) when it is not. */
#include "../gen/cuda_rules.h"

#endif  /* DISTEMB_CUDA_H_ */
