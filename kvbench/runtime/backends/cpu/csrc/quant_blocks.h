/* The blocks of one row, values [k0, k0 + n), handed value-vector by value-vector to EMIT(offset, slot, vector)
 * (offset from y, which advances a block at a time; slot: one of 4 independent accumulators): included by
 * dequant_span (EMIT stores) and dot_span (EMIT multiplies with the input rows). ggml's dequantize_row_* per type. */
{
    const int bv = block_values(type), bb = block_bytes(type);
    const uint8_t *b = row + k0 / bv * bb;
    const uint8_t *end = b + n / bv * bb;
    switch (type) {
    case GGML_Q8_0:
        for (; b < end; b += bb, y += 32) {
            const float d = h2f(rd16(b));
            for (int i = 0; i < 32; i += QN) {
                EMIT(i, (i / QN) & 3, QF(tof)(QF(widen)(b + 2 + i, 1)) * d);
            }
        }
        break;
    case GGML_Q4_0:
        for (; b < end; b += bb, y += 32) {
            const float d = h2f(rd16(b));
            for (int i = 0; i < 16; i += QN) { /* QN <= 16: byte i holds values i (low nibble) and i + 16 (high) */
                const QF(vi) q = QF(load_wide)(b + 2 + i);
                EMIT(i, (i / QN) & 1, QF(tof)((q & 0xF) - 8) * d);
                EMIT(16 + i, 2 + ((i / QN) & 1), QF(tof)((q >> 4) - 8) * d);
            }
        }
        break;
    case GGML_Q5_0: {
        QF(vi) lane;
        for (int i = 0; i < QN; i++) lane[i] = i;
        for (; b < end; b += bb, y += 32) {
            const float d = h2f(rd16(b));
            const uint32_t qh = rd32(b + 2); /* bit e: the fifth bit of value e */
            for (int i = 0; i < 16; i += QN) {
                const QF(vi) q = QF(load_wide)(b + 6 + i);
                const QF(vi) h0 = ((qh >> (lane + i)) & 1) << 4, h1 = ((qh >> (lane + i + 16)) & 1) << 4;
                EMIT(i, (i / QN) & 1, QF(tof)(((q & 0xF) | h0) - 16) * d);
                EMIT(16 + i, 2 + ((i / QN) & 1), QF(tof)(((q >> 4) | h1) - 16) * d);
            }
        }
        break;
    }
    case GGML_Q4_K:
        for (; b < end; b += bb, y += 256) {
            const float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
            const uint8_t *sc = b + 4, *q = b + 16;
            for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
                float s1, m1, s2, m2;
                scale_min_k4(is, sc, &s1, &m1);
                scale_min_k4(is + 1, sc, &s2, &m2);
                const float d1 = d * s1, o1 = dmin * m1, d2 = d * s2, o2 = dmin * m2;
                for (int l = 0; l < 32; l += QN) {
                    const QF(vi) v = QF(load_wide)(q + l);
                    EMIT(j + l, (l / QN) & 1, QF(tof)(v & 0xF) * d1 - o1);
                    EMIT(j + 32 + l, 2 + ((l / QN) & 1), QF(tof)(v >> 4) * d2 - o2);
                }
            }
        }
        break;
    case GGML_Q5_K:
        for (; b < end; b += bb, y += 256) {
            const float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
            const uint8_t *sc = b + 4, *qh = b + 16, *ql = b + 48;
            int shift = 0;
            for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32, shift += 2) {
                float s1, m1, s2, m2;
                scale_min_k4(is, sc, &s1, &m1);
                scale_min_k4(is + 1, sc, &s2, &m2);
                const float d1 = d * s1, o1 = dmin * m1, d2 = d * s2, o2 = dmin * m2;
                for (int l = 0; l < 32; l += QN) {
                    const QF(vi) v = QF(load_wide)(ql + l), h = QF(load_wide)(qh + l);
                    const QF(vi) lo = (v & 0xF) | (((h >> shift) & 1) << 4);
                    const QF(vi) hi = (v >> 4) | (((h >> (shift + 1)) & 1) << 4);
                    EMIT(j + l, (l / QN) & 1, QF(tof)(lo) * d1 - o1);
                    EMIT(j + 32 + l, 2 + ((l / QN) & 1), QF(tof)(hi) * d2 - o2);
                }
            }
        }
        break;
    case GGML_Q6_K:
        for (; b < end; b += bb, y += 256) {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = h2f(rd16(b + 208));
            for (int n0 = 0; n0 < 256; n0 += 128, ql += 64, qh += 32, sc += 8) {
                for (int l = 0; l < 32; l += QN) { /* values l..l+QN-1 share sub-scales (16 values each) */
                    const int is = l / 16;
                    const QF(vi) a = QF(load_wide)(ql + l), c = QF(load_wide)(ql + l + 32), h = QF(load_wide)(qh + l);
                    const QF(vi) q1 = (a & 0xF) | ((h & 3) << 4), q2 = (c & 0xF) | (((h >> 2) & 3) << 4);
                    const QF(vi) q3 = (a >> 4) | (((h >> 4) & 3) << 4), q4 = (c >> 4) | (((h >> 6) & 3) << 4);
                    EMIT(n0 + l, 0, QF(tof)(q1 - 32) * (d * sc[is]));
                    EMIT(n0 + l + 32, 1, QF(tof)(q2 - 32) * (d * sc[is + 2]));
                    EMIT(n0 + l + 64, 2, QF(tof)(q3 - 32) * (d * sc[is + 4]));
                    EMIT(n0 + l + 96, 3, QF(tof)(q4 - 32) * (d * sc[is + 6]));
                }
            }
        }
        break;
    }
}
