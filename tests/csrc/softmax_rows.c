/* bf_softmax_row4 (four rows of the bf16 decode path at once) against bf_softmax_row (one
 * row): the same bits for every row's maximum, sum, rescaled outputs and weights, over random
 * scores, contexts and running states (a first round's -inf maximum included).
 *
 *     softmax_rows SEED TRIALS   prints "<rows that differ> of <rows>" */
#include "decode_attention.c"

#include <stdio.h>

static unsigned state;
static float uniform(float lo, float hi) { /* a small LCG: the same draws on every compiler */
    state = state * 1103515245u + 12345u;
    return lo + (hi - lo) * (float)((state >> 8) & 0xffff) / 65536.0f;
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    state = (unsigned)strtoul(argv[1], NULL, 10);
    const int trials = atoi(argv[2]);
    static BfRows one, four;
    long differ = 0, rows_seen = 0;
    for (int t = 0; t < trials; t++) {
        const int hi = 1 + t % 4, r0 = ROUND * (t % 3); /* 1-4 live rows, rounds past the first */
        __m512 s1[4][ROUND / 16], s4[4][ROUND / 16];
        for (int r = 0; r < 4; r++) {
            const float m = t % 5 == 0 ? -INFINITY : uniform(-4.0f, 4.0f);
            one.m[r] = four.m[r] = m;
            one.l[r] = four.l[r] = m == -INFINITY ? 0.0f : uniform(0.0f, 40.0f);
            one.ctx[r] = four.ctx[r] = r0 + 1 + (int)uniform(0.0f, 70.0f); /* some keys masked */
            for (int v = 0; v < 4; v++)
                one.acc[r][v] = four.acc[r][v] = _mm512_set1_ps(uniform(-4.0f, 4.0f));
            for (int kb = 0; kb < ROUND / 16; kb++) {
                float f[16];
                for (int j = 0; j < 16; j++) f[j] = uniform(-12.0f, 12.0f);
                s1[r][kb] = s4[r][kb] = _mm512_loadu_ps(f);
            }
        }
        for (int r = hi; r < 4; r++) /* the four-row path repeats its last live row */
            for (int kb = 0; kb < ROUND / 16; kb++) s4[r][kb] = s4[hi - 1][kb];
        uint32_t pw1[4][ROUND / 2], pw4[4][ROUND / 2];
        memset(pw1, 0, sizeof pw1);
        memset(pw4, 0, sizeof pw4);
        for (int r = 0; r < hi; r++) bf_softmax_row(&one, r, s1[r], r0, 0.125f, pw1[r], 4);
        bf_softmax_row4(&four, 0, hi, s4, r0, 0.125f, pw4, 4);
        for (int r = 0; r < hi; r++, rows_seen++)
            differ += memcmp(&one.l[r], &four.l[r], sizeof(float)) ||
                      memcmp(&one.m[r], &four.m[r], sizeof(float)) ||
                      memcmp(pw1[r], pw4[r], sizeof pw1[r]) ||
                      memcmp(one.acc[r], four.acc[r], 4 * sizeof(__m512));
    }
    printf("%ld of %ld\n", differ, rows_seen);
    return 0;
}
