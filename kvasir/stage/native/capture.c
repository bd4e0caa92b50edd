/* The boundary capture callback in C (see kvasir/stage/capture.py).
 *
 * ggml's scheduler asks an eval callback about every graph node (hundreds per decode); answering from Python costs
 * about 1.5 us a node. This one compares the node's name and copies the wanted node's rows out, nothing else.
 * Struct offsets come from Python, so no ggml header is needed to build it.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef void (*tensor_get_fn)(const void *tensor, void *data, size_t offset, size_t size);

struct kvasir_capture {
    char name[64];             /* node to capture, e.g. "l_out-5" */
    size_t name_offset;        /* offsetof(struct ggml_tensor, name) */
    size_t type_offset;        /* offsetof(struct ggml_tensor, type) */
    size_t ne_offset;          /* offsetof(struct ggml_tensor, ne) */
    tensor_get_fn tensor_get;  /* ggml_backend_tensor_get */
    float *dst;                /* rows x n_embd floats */
    int64_t capacity_rows;
    int64_t rows;              /* rows captured so far; -1 after an error */
    int64_t n_embd;
};

bool kvasir_capture_eval(void *tensor, bool ask, void *user) {
    struct kvasir_capture *c = (struct kvasir_capture *)user;
    const char *name = (const char *)tensor + c->name_offset;
    if (strncmp(name, c->name, sizeof c->name) != 0) {
        return !ask;
    }
    if (ask) {
        return true;
    }
    int32_t type = *(const int32_t *)((const char *)tensor + c->type_offset);
    const int64_t *ne = (const int64_t *)((const char *)tensor + c->ne_offset);
    if (c->rows < 0 || type != 0 /* GGML_TYPE_F32 */ || ne[0] != c->n_embd || c->rows + ne[1] > c->capacity_rows) {
        c->rows = -1;
        return true;
    }
    c->tensor_get(tensor, c->dst + c->rows * c->n_embd, 0, (size_t)(ne[1] * c->n_embd) * sizeof(float));
    c->rows += ne[1];
    return true;
}
