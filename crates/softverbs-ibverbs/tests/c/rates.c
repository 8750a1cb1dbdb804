/* Built by tests/capi.rs and run twice, over rdma-core's libibverbs and over the softverbs
 * drop-in: the pure rate conversions must print the same. */
#include <infiniband/verbs.h>
#include <stdio.h>

int main(void) {
    for (int r = -1; r <= 40; r++)
        printf("rate %d: mult %d mbps %d\n", r, ibv_rate_to_mult((enum ibv_rate)r),
               ibv_rate_to_mbps((enum ibv_rate)r));
    for (int m = -1; m <= 1000; m++) {
        enum ibv_rate r = mult_to_ibv_rate(m);
        if (r != IBV_RATE_MAX)
            printf("mult %d: rate %d\n", m, r);
    }
    for (int r = 0; r <= 40; r++) {
        int mbps = ibv_rate_to_mbps((enum ibv_rate)r);
        for (int d = -1; d <= 1; d++)
            printf("mbps %d: rate %d\n", mbps + d, mbps_to_ibv_rate(mbps + d));
    }
    printf("ok\n");
    return 0;
}
