/* Histogram of |x| for calibration: the one loop numpy cannot do in a single pass.
 *
 * RangeState.update (histogram.py) bins a float32 tensor as floor(|x| * inv) with inv the float32
 * 1/width; numpy needs abs, multiply, a float->int cast and np.bincount, four passes and two
 * temporaries. This function does the same arithmetic (a float32 multiply, truncation toward
 * zero, which is floor for |x| >= 0) straight from the tensor, so the counts are bit-for-bit those
 * of the numpy path. It releases the GIL, so one thread per core can each bin a tensor.
 *
 *   abs_hist(buf, inv, counts)      -> (max |x|, fits): in one pass over the data, when every index
 *                                   floor(|x| * inv) is below num_bins (the length of counts, a
 *                                   writable int64 buffer) and no value is NaN, counts[index] += 1 for
 *                                   each value and fits is True; otherwise counts is left as it was,
 *                                   so the caller grows the range to hold max |x| and calls again
 *
 * Built as an optional extension (setup.py); histogram.py falls back to numpy without it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* sub-histograms: the counter increments bound the loop (ResNet-50 activations are a third zeros,
   most of the rest in the lowest bins), and consecutive values in separate counters do not wait on
   each other. Measured on ResNet-50's activations: 16 lanes 1.58-1.65 ns per value, 8 lanes
   1.62-1.77, 4 lanes 2.06-2.13 (best of five, caches flushed between runs). */
#define LANES 16
#define FLUSH_EVERY ((Py_ssize_t)1 << 30)  /* values before a uint32 counter could wrap */

static int get_floats(PyObject *obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 4 || view->format == NULL || strcmp(view->format, "f") != 0) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "expected a C-contiguous float32 buffer");
        return -1;
    }
    return 0;
}

static PyObject *abs_hist(PyObject *self, PyObject *args)
{
    PyObject *obj, *cobj;
    float inv;
    Py_buffer view, cview;
    if (!PyArg_ParseTuple(args, "OfO", &obj, &inv, &cobj) || get_floats(obj, &view) < 0)
        return NULL;
    if (PyObject_GetBuffer(cobj, &cview, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (cview.itemsize != 8 || cview.format == NULL
            || (strcmp(cview.format, "q") != 0 && strcmp(cview.format, "l") != 0) || cview.len < 8) {
        PyBuffer_Release(&view);
        PyBuffer_Release(&cview);
        PyErr_SetString(PyExc_TypeError, "counts must be a writable, non-empty C-contiguous int64 buffer");
        return NULL;
    }
    const float *x = (const float *)view.buf;
    Py_ssize_t n = view.len / 4;
    int64_t *counts = (int64_t *)cview.buf;
    Py_ssize_t bins = cview.len / 8;
    uint32_t *lanes = (uint32_t *)calloc((size_t)bins * LANES, sizeof(uint32_t));
    int64_t *acc = (int64_t *)calloc((size_t)bins, sizeof(int64_t));
    if (lanes == NULL || acc == NULL) {
        free(lanes);
        free(acc);
        PyBuffer_Release(&view);
        PyBuffer_Release(&cview);
        return PyErr_NoMemory();
    }
    float m = 0.0f;
    int nan = 0, fits = 0;
    Py_BEGIN_ALLOW_THREADS
    const uint32_t last = (uint32_t)(bins - 1);
    float mx[LANES] = {0.0f};
    int n0 = 0;
    Py_ssize_t start = 0;
    while (start < n) {
        Py_ssize_t stop = n - start > FLUSH_EVERY ? start + FLUSH_EVERY : n;
        Py_ssize_t i = start;
        for (; i + LANES <= stop; i += LANES) {
            /* value l of each group goes to sub-histogram l (the compiler unrolls this loop) */
            for (int l = 0; l < LANES; l++) {
                float a = fabsf(x[i + l]);
                n0 |= (a != a);
                mx[l] = a > mx[l] ? a : mx[l];
                /* |x| * inv in float32, truncated: floor for non-negative values, as numpy's astype;
                   out-of-range indices are clamped only to stay in bounds (such a call counts nothing) */
                uint32_t k = (uint32_t)(int32_t)(a * inv);
                lanes[(size_t)l * bins + (k < last ? k : last)]++;
            }
        }
        for (; i < stop; i++) {
            float a = fabsf(x[i]);
            n0 |= (a != a);
            mx[0] = a > mx[0] ? a : mx[0];
            uint32_t k = (uint32_t)(int32_t)(a * inv);
            lanes[k < last ? k : last]++;
        }
        for (Py_ssize_t b = 0; b < bins; b++) {
            int64_t s = 0;
            for (int l = 0; l < LANES; l++)
                s += lanes[(size_t)l * bins + b];
            acc[b] += s;
        }
        memset(lanes, 0, (size_t)bins * LANES * sizeof(uint32_t));
        start = stop;
    }
    for (int l = 0; l < LANES; l++)
        m = mx[l] > m ? mx[l] : m;
    nan = n0;
    /* the largest value has the largest index: the batch fits when its index is in range */
    fits = !nan && (m * inv) < (float)bins;
    if (fits)
        for (Py_ssize_t b = 0; b < bins; b++)
            counts[b] += acc[b];
    Py_END_ALLOW_THREADS
    free(lanes);
    free(acc);
    PyBuffer_Release(&view);
    PyBuffer_Release(&cview);
    return Py_BuildValue("(dO)", nan ? (double)NAN : (double)m, fits ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"abs_hist", abs_hist, METH_VARARGS,
     "abs_hist(x, inv, counts) -> (amax, fits): counts[floor(|x| * inv)] += 1 if every index fits"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_abshist", NULL, -1, methods};

PyMODINIT_FUNC PyInit__abshist(void) { return PyModule_Create(&module); }
