/* The libnrt declarations polyaccel.neuron.nrt binds through ctypes, re-typed by hand from the
 * published Neuron Runtime headers so tests/neuron/test_nrt_abi.py can compare our ctypes
 * layouts and prototypes with them:
 *   github.com/aws-neuron/aws-neuron-sdk  src/libnrt/include/nrt/nrt.h and nrt_experimental.h
 *   at commit 86a9286833dc2a1cd23b674f7081061924aa587a (runtime API NRT_MAJOR_VERSION 2,
 *   NRT_MINOR_VERSION 0), and nrt_status.h at commit 56dcc0f99c705b3c973d0983784e92fd1464c324.
 * Declarations only, and only the ones we call; see those headers for the documentation.
 * One line per prototype: the test parses them. */
#pragma once
#include <stddef.h>
#include <stdint.h>

typedef enum {
    NRT_SUCCESS = 0, NRT_FAILURE = 1, NRT_INVALID = 2, NRT_INVALID_HANDLE = 3, NRT_RESOURCE = 4,
    NRT_TIMEOUT = 5, NRT_HW_ERROR = 6, NRT_QUEUE_FULL = 7, NRT_LOAD_NOT_ENOUGH_NC = 9,
    NRT_UNSUPPORTED_NEFF_VERSION = 10, NRT_UNINITIALIZED = 13, NRT_CLOSED = 14,
    NRT_EXEC_BAD_INPUT = 1002, NRT_EXEC_COMPLETED_WITH_NUM_ERR = 1003, NRT_EXEC_COMPLETED_WITH_ERR = 1004,
    NRT_EXEC_NC_BUSY = 1005, NRT_COLL_PENDING = 1100,
} NRT_STATUS;

typedef struct nrt_model nrt_model_t;
typedef struct nrt_tensor nrt_tensor_t;
typedef void nrt_tensor_set_t;

typedef enum { NRT_TENSOR_PLACEMENT_DEVICE, NRT_TENSOR_PLACEMENT_HOST, NRT_TENSOR_PLACEMENT_VIRTUAL } nrt_tensor_placement_t;

typedef enum {
    NRT_FRAMEWORK_TYPE_INVALID = 0, NRT_FRAMEWORK_TYPE_NO_FW = 1, NRT_FRAMEWORK_TYPE_TENSORFLOW,
    NRT_FRAMEWORK_TYPE_PYTORCH, NRT_FRAMEWORK_TYPE_MXNET,
} nrt_framework_type_t;

typedef enum nrt_dtype {
    NRT_DTYPE_UNKNOWN = 0x0, NRT_DTYPE_UINT64 = 0x1, NRT_DTYPE_INT8 = 0x2, NRT_DTYPE_UINT8 = 0x3,
    NRT_DTYPE_INT16 = 0x4, NRT_DTYPE_UINT16 = 0x5, NRT_DTYPE_BFLOAT16 = 0x6, NRT_DTYPE_FLOAT16 = 0x7,
    NRT_DTYPE_INT32 = 0x8, NRT_DTYPE_UINT32 = 0x9, NRT_DTYPE_FLOAT32 = 0xA, NRT_DTYPE_FP32R = 0xB,
    NRT_DTYPE_INT64 = 0xC, NRT_DTYPE_FP8_E3 = 0xD, NRT_DTYPE_FP8_E4 = 0xE, NRT_DTYPE_FP8_E5 = 0xF,
} nrt_dtype_t;

typedef enum nrt_tensor_usage { NRT_TENSOR_USAGE_INPUT = 0, NRT_TENSOR_USAGE_OUTPUT } nrt_tensor_usage_t;

#define NRT_TENSOR_NAME_MAX 256

typedef struct nrt_tensor_info {
    char name[NRT_TENSOR_NAME_MAX];
    nrt_tensor_usage_t usage;
    size_t size;
    nrt_dtype_t dtype;
    uint32_t *shape;
    uint32_t ndim;
} nrt_tensor_info_t;

typedef struct nrt_tensor_info_array {
    uint64_t tensor_count;
    nrt_tensor_info_t tensor_array[];
} nrt_tensor_info_array_t;

NRT_STATUS nrt_init(nrt_framework_type_t framework, const char *fw_version, const char *fal_version);
void nrt_close(void);
NRT_STATUS nrt_load(const void *neff_bytes, size_t size, int32_t vnc, int32_t vnc_count, nrt_model_t **model);
NRT_STATUS nrt_unload(nrt_model_t *model);
NRT_STATUS nrt_tensor_allocate(nrt_tensor_placement_t tensor_placement, int vnc, size_t size, const char *name, nrt_tensor_t **tensor);
void nrt_tensor_free(nrt_tensor_t **tensor);
NRT_STATUS nrt_tensor_write(nrt_tensor_t *tensor, const void *buf, size_t offset, size_t size);
NRT_STATUS nrt_tensor_read(const nrt_tensor_t *tensor, void *buf, size_t offset, size_t size);
NRT_STATUS nrt_allocate_tensor_set(nrt_tensor_set_t **result);
NRT_STATUS nrt_add_tensor_to_tensor_set(nrt_tensor_set_t *tensor_set, const char *tensor_name, nrt_tensor_t *tensor);
void nrt_destroy_tensor_set(nrt_tensor_set_t **tensor_set);
NRT_STATUS nrt_execute(nrt_model_t *model, const nrt_tensor_set_t *input_set, nrt_tensor_set_t *output_set);
NRT_STATUS nrt_get_model_tensor_info(nrt_model_t *model, nrt_tensor_info_array_t **tensor_info);
NRT_STATUS nrt_free_model_tensor_info(nrt_tensor_info_array_t *tensor_info);
