/* vLLM's default block hash (``sha256`` over ``pickle.dumps((parent, tokens, None), 5)``) for
 * a run of plain blocks, in C: the native half of ``kvroute/core/native_hashing.py``.
 *
 * One call hashes every full block of a token buffer, each chained from the one before, and
 * returns the digests and their 64-bit wire forms. It writes the exact bytes CPython's C
 * pickler writes for that tuple at protocol 5 (PROTO, one FRAME, SHORT_BINBYTES + MEMOIZE
 * for the parent digest, the tokens as a tuple of BININT1/BININT2/BININT/LONG1 ints, NONE,
 * TUPLE3, MEMOIZE, STOP) and digests them with its own SHA-256 (FIPS 180-4), so it needs no
 * library beyond Python's headers. Blocks with extra keys (salt, LoRA, multimodal) and the
 * other algorithms stay in Python; the Python loop is the reference the property tests
 * compare this with (tests/unit/core/test_native_hashing.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* -- SHA-256 ------------------------------------------------------------------------------ */

static const uint32_t K256[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u,
    0xab1c5ed5u, 0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu,
    0x9bdc06a7u, 0xc19bf174u, 0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu,
    0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau, 0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u,
    0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u, 0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu,
    0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u, 0xa2bfe8a1u, 0xa81a664bu,
    0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u, 0x19a4c116u,
    0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u,
    0xc67178f2u};

static const uint32_t H256[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                                 0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_compress(uint32_t state[8], const unsigned char *block) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++) {
        w[i] = ((uint32_t)block[4 * i] << 24) | ((uint32_t)block[4 * i + 1] << 16) |
               ((uint32_t)block[4 * i + 2] << 8) | (uint32_t)block[4 * i + 3];
    }
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROTR(w[i - 15], 7) ^ ROTR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROTR(w[i - 2], 17) ^ ROTR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
    uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) + ((e & f) ^ (~e & g)) +
                      K256[i] + w[i];
        uint32_t t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g; g = f; f = e; e = d + t1;
        d = c; c = b; b = a; a = t1 + t2;
    }
    state[0] += a; state[1] += b; state[2] += c; state[3] += d;
    state[4] += e; state[5] += f; state[6] += g; state[7] += h;
}

/* The digest of msg[0:len]; msg must have room for len + 72 bytes (the padding is written in
 * place). */
static void sha256_digest(unsigned char *msg, size_t len, unsigned char out[32]) {
    uint32_t state[8];
    memcpy(state, H256, sizeof state);
    size_t padded = ((len + 8) / 64 + 1) * 64;
    msg[len] = 0x80;
    memset(msg + len + 1, 0, padded - len - 1);
    uint64_t bits = (uint64_t)len * 8;
    for (int i = 0; i < 8; i++) {
        msg[padded - 1 - i] = (unsigned char)(bits >> (8 * i));
    }
    for (size_t off = 0; off < padded; off += 64) {
        sha256_compress(state, msg + off);
    }
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (unsigned char)(state[i] >> 24);
        out[4 * i + 1] = (unsigned char)(state[i] >> 16);
        out[4 * i + 2] = (unsigned char)(state[i] >> 8);
        out[4 * i + 3] = (unsigned char)state[i];
    }
}

/* -- pickle protocol 5 of (parent: bytes[32], tokens: tuple[int, ...], None) ------------- */

/* Writes one non-negative int as CPython's pickler does; returns the bytes written (<= 11). */
static size_t pickle_uint(unsigned char *p, uint64_t v) {
    if (v <= 0xffu) {
        p[0] = 'K';
        p[1] = (unsigned char)v;
        return 2;
    }
    if (v <= 0xffffu) {
        p[0] = 'M';
        p[1] = (unsigned char)v;
        p[2] = (unsigned char)(v >> 8);
        return 3;
    }
    if (v <= 0x7fffffffu) {
        p[0] = 'J';
        for (int i = 0; i < 4; i++) p[1 + i] = (unsigned char)(v >> (8 * i));
        return 5;
    }
    /* LONG1: little-endian two's complement, (bit_length // 8) + 1 bytes. */
    int nbits = 64 - __builtin_clzll(v);
    int nbytes = nbits / 8 + 1;
    p[0] = 0x8a;
    p[1] = (unsigned char)nbytes;
    for (int i = 0; i < nbytes; i++) p[2 + i] = i < 8 ? (unsigned char)(v >> (8 * i)) : 0;
    return (size_t)(2 + nbytes);
}

/* The pickle of one block into buf; returns its length. */
static size_t pickle_block(unsigned char *buf, const unsigned char *parent, Py_ssize_t plen,
                           const void *tokens, int itemsize, Py_ssize_t start, Py_ssize_t bs) {
    unsigned char *p = buf;
    *p++ = 0x80;  /* PROTO 5 */
    *p++ = 5;
    unsigned char *frame = p;
    p += 9;       /* FRAME + 8-byte length, filled in below */
    *p++ = 'C';   /* SHORT_BINBYTES */
    *p++ = (unsigned char)plen;
    memcpy(p, parent, (size_t)plen);
    p += plen;
    *p++ = 0x94;  /* MEMOIZE */
    if (bs > 3) *p++ = '(';  /* MARK */
    for (Py_ssize_t i = 0; i < bs; i++) {
        uint64_t v = itemsize == 4 ? ((const uint32_t *)tokens)[start + i]
                                   : ((const uint64_t *)tokens)[start + i];
        p += pickle_uint(p, v);
    }
    if (bs > 3) {
        *p++ = 't';  /* TUPLE */
    } else {
        *p++ = (unsigned char)(0x84 + bs);  /* TUPLE1..TUPLE3 */
    }
    *p++ = 0x94;  /* MEMOIZE */
    *p++ = 'N';
    *p++ = 0x87;  /* TUPLE3 */
    *p++ = 0x94;  /* MEMOIZE */
    *p++ = '.';   /* STOP */
    uint64_t frame_len = (uint64_t)(p - frame - 9);
    frame[0] = 0x95;  /* FRAME (always >= 4 bytes here) */
    for (int i = 0; i < 8; i++) frame[1 + i] = (unsigned char)(frame_len >> (8 * i));
    return (size_t)(p - buf);
}

/* sha256_chain(parent: bytes, tokens: buffer, itemsize: 4 | 8, block_size: int)
 *     -> tuple[list[bytes], list[int]]; tokens holds native-endian unsigned ints of itemsize
 * bytes (the raw bytes of an array('I') or array('Q')). */
static PyObject *sha256_chain(PyObject *self, PyObject *args) {
    Py_buffer parent, tokens;
    Py_ssize_t bs;
    int itemsize;
    if (!PyArg_ParseTuple(args, "y*y*in", &parent, &tokens, &itemsize, &bs)) return NULL;
    PyObject *digests = NULL, *wires = NULL, *result = NULL;
    unsigned char *buf = NULL;
    if (parent.len != 32) {
        PyErr_Format(PyExc_ValueError, "parent must be a 32-byte sha256 digest, got %zd bytes",
                     parent.len);
        goto done;
    }
    if (bs < 1) {
        PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %zd", bs);
        goto done;
    }
    if (itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_TypeError, "tokens must be a buffer of 4- or 8-byte unsigned ints");
        goto done;
    }
    Py_ssize_t n = tokens.len / itemsize;
    Py_ssize_t blocks = n / bs;
    /* 2 + 9 + 2 + 32 + 1 + 1 + 11 a token + 6, and 72 bytes of SHA-256 padding. */
    buf = PyMem_Malloc((size_t)(bs * 11 + 128));
    digests = PyList_New(blocks);
    wires = PyList_New(blocks);
    if (buf == NULL || digests == NULL || wires == NULL) {
        if (buf == NULL) PyErr_NoMemory();
        goto done;
    }
    unsigned char prev[32];
    memcpy(prev, parent.buf, 32);
    for (Py_ssize_t b = 0; b < blocks; b++) {
        size_t len = pickle_block(buf, prev, 32, tokens.buf, itemsize, b * bs, bs);
        sha256_digest(buf, len, prev);
        PyObject *digest = PyBytes_FromStringAndSize((const char *)prev, 32);
        if (digest == NULL) goto done;
        PyList_SET_ITEM(digests, b, digest);
        uint64_t wire = 0;
        for (int i = 24; i < 32; i++) wire = (wire << 8) | prev[i];
        PyObject *w = PyLong_FromUnsignedLongLong(wire);
        if (w == NULL) goto done;
        PyList_SET_ITEM(wires, b, w);
    }
    result = PyTuple_Pack(2, digests, wires);
done:
    PyMem_Free(buf);
    Py_XDECREF(digests);
    Py_XDECREF(wires);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&tokens);
    return result;
}

/* pickle_block(parent: bytes, tokens: buffer, itemsize: 4 | 8, block_size: int) -> bytes:
 * the first block's pickle, for the tests that compare it with pickle.dumps. */
static PyObject *pickle_first_block(PyObject *self, PyObject *args) {
    Py_buffer parent, tokens;
    Py_ssize_t bs;
    int itemsize;
    if (!PyArg_ParseTuple(args, "y*y*in", &parent, &tokens, &itemsize, &bs)) return NULL;
    PyObject *out = NULL;
    if (parent.len > 255 || bs < 1 || (itemsize != 4 && itemsize != 8) ||
        tokens.len / itemsize < bs) {
        PyErr_SetString(PyExc_ValueError, "bad arguments to pickle_block");
    } else {
        unsigned char *buf = PyMem_Malloc((size_t)(bs * 11 + parent.len + 128));
        if (buf == NULL) {
            PyErr_NoMemory();
        } else {
            size_t len = pickle_block(buf, parent.buf, parent.len, tokens.buf, itemsize, 0, bs);
            out = PyBytes_FromStringAndSize((const char *)buf, (Py_ssize_t)len);
            PyMem_Free(buf);
        }
    }
    PyBuffer_Release(&parent);
    PyBuffer_Release(&tokens);
    return out;
}

static PyMethodDef methods[] = {
    {"sha256_chain", sha256_chain, METH_VARARGS,
     "sha256_chain(parent, tokens, itemsize, block_size) -> (digests, wire_hashes) of every full block"},
    {"pickle_block", pickle_first_block, METH_VARARGS,
     "pickle_block(parent, tokens, itemsize, block_size) -> the first block's pickle bytes"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockhash",
                                    "vLLM's sha256 block hash chain in C", -1, methods};

PyMODINIT_FUNC PyInit__blockhash(void) { return PyModule_Create(&module); }
