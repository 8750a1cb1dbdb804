/* softverbs/verbs_ext.h: softverbs' extensions to rdma-core's <infiniband/verbs.h>.
 *
 * The compact completion records of the "Completion timestamping" patch series (seed 000,
 * "[PATCH V1 libibverbs 1/8] Add ibv_poll_cq_ex verb", 4/8 and 5/8): ibv_poll_cq_ex fills
 * caller memory with records that hold a fixed header (struct ibv_wc_ex) followed by exactly
 * the fields the CQ was created with, 64-bit fields first, then 32-, 16- and 8-bit ones (each
 * class in flag-bit order), the whole record rounded up to 8 bytes. The ibv_wc_ex_get*
 * helpers below find a field with the seed's formulas.
 *
 * The shipped <infiniband/verbs.h> stays the ABI contract: create the CQ with its
 * ibv_create_cq_ex() and its IBV_WC_EX_WITH_* flags (enum ibv_create_cq_wc_flags), or with
 * ibv_create_cq() (IBV_WC_STANDARD_FLAGS); any CQ of the softverbs library can be polled with
 * ibv_poll_cq, ibv_start_poll/ibv_next_poll/ibv_end_poll and ibv_poll_cq_ex alike.
 *
 * WHY THE "SEED" PREFIX. The seed numbered its flags differently from what rdma-core later
 * shipped: the seed has output flags in bits 0-3 and IBV_WC_EX_WITH_BYTE_LEN = 1 << 4, ...,
 * while the shipped enum ibv_create_cq_wc_flags has IBV_WC_EX_WITH_BYTE_LEN = 1 << 0, ...
 * (and its own IBV_WC_STANDARD_FLAGS). The seed's names cannot be defined next to the shipped
 * header, and its layout formulas depend on its bit order (fields are placed in flag-bit order
 * within a size class), so the seed's flags are kept with their values under the prefix
 * IBV_WC_EX_SEED_. Use:
 *   - shipped IBV_WC_EX_WITH_* values to create a CQ (ibv_cq_init_attr_ex.wc_flags);
 *   - IBV_WC_EX_SEED_* values with ibv_poll_cq_ex records and the ibv_wc_ex_get* helpers,
 *     together with ibv_wc_ex_cq_flags(cq) (or ibv_wc_ex_seed_flags(create_wc_flags)).
 * IBV_WC_EX_SEED_WITH_COMPLETION_TIMESTAMP is the seed's bit 12 (patch 4/8);
 * IBV_WC_EX_SEED_WITH_COMPLETION_TIMESTAMP_WALLCLOCK (bit 13) is softverbs' addition, a 64-bit
 * field placed after the seed's one as its compatibility rule asks.
 *
 * Linking: ibv_poll_cq_ex and ibv_wc_ex_cq_flags are exported by the softverbs libibverbs.so.1
 * only (symbol version SOFTVERBS_1.0), so link against it, e.g.
 *   cc -I<softverbs>/crates/softverbs-ibverbs/include prog.c -L<dir> -libverbs
 * where <dir>/libibverbs.so is the softverbs library (target/<profile>/libibverbs.so), and run
 * the program with `softverbs run -- prog` (or LD_LIBRARY_PATH pointing there).
 */
#ifndef SOFTVERBS_VERBS_EXT_H
#define SOFTVERBS_VERBS_EXT_H

#include <stddef.h>
#include <stdint.h>
#include <infiniband/verbs.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Feature test: this header's interface version. */
#define SOFTVERBS_VERBS_EXT 1

/* The seed's enum ibv_wc_flags_ex with the seed's values (see above for the prefix). Bits 0-3
 * are output flags of a record; bits 4 and up name the fields a CQ's records carry. */
enum ibv_wc_flags_ex {
	IBV_WC_EX_SEED_GRH				= 1 << 0, /* buffer starts with a GRH */
	IBV_WC_EX_SEED_IMM				= 1 << 1, /* immediate data present */
	IBV_WC_EX_SEED_CSUM_OK				= 1 << 2, /* IP checksum verified */
	IBV_WC_EX_SEED_INV				= 1 << 3, /* a key was invalidated */
	IBV_WC_EX_SEED_WITH_BYTE_LEN			= 1 << 4,
	IBV_WC_EX_SEED_WITH_IMM				= 1 << 5,
	IBV_WC_EX_SEED_WITH_QP_NUM			= 1 << 6,
	IBV_WC_EX_SEED_WITH_SRC_QP			= 1 << 7,
	IBV_WC_EX_SEED_WITH_PKEY_INDEX			= 1 << 8, /* never set by softverbs */
	IBV_WC_EX_SEED_WITH_SLID			= 1 << 9,
	IBV_WC_EX_SEED_WITH_SL				= 1 << 10,
	IBV_WC_EX_SEED_WITH_DLID_PATH_BITS		= 1 << 11,
	IBV_WC_EX_SEED_WITH_COMPLETION_TIMESTAMP	= 1 << 12,
	IBV_WC_EX_SEED_WITH_COMPLETION_TIMESTAMP_WALLCLOCK = 1 << 13,
};

/* The seed's IBV_WC_STANDARD_FLAGS (the shipped header has its own, with other values). */
enum {
	IBV_WC_EX_SEED_STANDARD_FLAGS = IBV_WC_EX_SEED_WITH_BYTE_LEN		|
					IBV_WC_EX_SEED_WITH_IMM			|
					IBV_WC_EX_SEED_WITH_QP_NUM		|
					IBV_WC_EX_SEED_WITH_SRC_QP		|
					IBV_WC_EX_SEED_WITH_PKEY_INDEX		|
					IBV_WC_EX_SEED_WITH_SLID		|
					IBV_WC_EX_SEED_WITH_SL			|
					IBV_WC_EX_SEED_WITH_DLID_PATH_BITS
};

/* Fields of a record after its header, in this order (a field is present only if its flag is
 * in the CQ's creation flags):
 *	uint64_t	completion_timestamp;		raw device clock
 *	uint64_t	completion_timestamp_wallclock;	CLOCK_REALTIME nanoseconds
 *	uint32_t	byte_len;
 *	uint32_t	imm_data;			network byte order, as ibv_wc's
 *	uint32_t	qp_num;
 *	uint32_t	src_qp;
 *	uint16_t	pkey_index;
 *	uint16_t	slid;
 *	uint8_t		sl;
 *	uint8_t		dlid_path_bits;
 */
enum {
	IBV_WC_EX_SEED_WITH_64BIT_FIELDS = IBV_WC_EX_SEED_WITH_COMPLETION_TIMESTAMP |
					   IBV_WC_EX_SEED_WITH_COMPLETION_TIMESTAMP_WALLCLOCK
};

enum {
	IBV_WC_EX_SEED_WITH_32BIT_FIELDS = IBV_WC_EX_SEED_WITH_BYTE_LEN	|
					   IBV_WC_EX_SEED_WITH_IMM	|
					   IBV_WC_EX_SEED_WITH_QP_NUM	|
					   IBV_WC_EX_SEED_WITH_SRC_QP
};

enum {
	IBV_WC_EX_SEED_WITH_16BIT_FIELDS = IBV_WC_EX_SEED_WITH_PKEY_INDEX |
					   IBV_WC_EX_SEED_WITH_SLID
};

enum {
	IBV_WC_EX_SEED_WITH_8BIT_FIELDS = IBV_WC_EX_SEED_WITH_SL |
					  IBV_WC_EX_SEED_WITH_DLID_PATH_BITS
};

/* One record's fixed header (32 bytes); the fields follow in buffer[]. */
struct ibv_wc_ex {
	uint64_t		wr_id;
	/* The output flags (IBV_WC_EX_SEED_GRH ... _INV) and the IBV_WC_EX_SEED_WITH_* bits of
	 * the fields that are valid in this record. The record's layout is always the CQ's
	 * (ibv_wc_ex_cq_flags); a send completion leaves the receive-only fields (imm_data,
	 * src_qp, pkey_index, slid, sl, dlid_path_bits) invalid, and a failed completion keeps
	 * only qp_num and the timestamps. */
	uint64_t		wc_flags;
	uint32_t		status;		/* enum ibv_wc_status */
	uint32_t		opcode;		/* enum ibv_wc_opcode */
	uint32_t		vendor_err;
	uint32_t		reserved;
	uint8_t			buffer[];
};

struct ibv_poll_cq_ex_attr {
	unsigned int	max_entries;
	uint32_t	comp_mask;	/* no bits defined: must be 0 */
};

/**
 * ibv_poll_cq_ex - Poll a CQ for completions as compact records
 * @cq: any CQ of the softverbs library (ibv_cq_ex_to_cq() of an extended one)
 * @wc: room for @attr->max_entries records of ibv_wc_ex_get_size(ibv_wc_ex_cq_flags(cq))
 *      bytes each, 8-byte aligned; records are written back to back
 * @attr: @max_entries, and @comp_mask which must be 0
 *
 * Returns the number of records written (fewer than max_entries: the CQ was emptied), or a
 * negative errno: -EINVAL for a NULL or unknown @cq, a NULL @attr, unknown @attr->comp_mask
 * bits, or a NULL @wc with max_entries > 0.
 */
int ibv_poll_cq_ex(struct ibv_cq *cq, struct ibv_wc_ex *wc, struct ibv_poll_cq_ex_attr *attr);

/**
 * ibv_wc_ex_cq_flags - The CQ's creation flags in the seed's numbering
 *
 * The IBV_WC_EX_SEED_WITH_* bits of the fields @cq's records carry: the
 * cq_creation_wc_flags argument of the helpers below. Returns 0 and sets errno to EINVAL for
 * a NULL or unknown @cq (a CQ created with no fields also gives 0, with errno untouched).
 */
uint64_t ibv_wc_ex_cq_flags(struct ibv_cq *cq);

/* The seed flags of the fields a CQ created with the shipped IBV_WC_EX_WITH_* flags
 * @create_wc_flags carries (what ibv_wc_ex_cq_flags returns for it). */
static inline uint64_t ibv_wc_ex_seed_flags(uint64_t create_wc_flags)
{
	uint64_t f = 0;

	if (create_wc_flags & IBV_WC_EX_WITH_BYTE_LEN)
		f |= IBV_WC_EX_SEED_WITH_BYTE_LEN;
	if (create_wc_flags & IBV_WC_EX_WITH_IMM)
		f |= IBV_WC_EX_SEED_WITH_IMM;
	if (create_wc_flags & IBV_WC_EX_WITH_QP_NUM)
		f |= IBV_WC_EX_SEED_WITH_QP_NUM;
	if (create_wc_flags & IBV_WC_EX_WITH_SRC_QP)
		f |= IBV_WC_EX_SEED_WITH_SRC_QP;
	if (create_wc_flags & IBV_WC_EX_WITH_SLID)
		f |= IBV_WC_EX_SEED_WITH_SLID;
	if (create_wc_flags & IBV_WC_EX_WITH_SL)
		f |= IBV_WC_EX_SEED_WITH_SL;
	if (create_wc_flags & IBV_WC_EX_WITH_DLID_PATH_BITS)
		f |= IBV_WC_EX_SEED_WITH_DLID_PATH_BITS;
	if (create_wc_flags & IBV_WC_EX_WITH_COMPLETION_TIMESTAMP)
		f |= IBV_WC_EX_SEED_WITH_COMPLETION_TIMESTAMP;
	if (create_wc_flags & IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK)
		f |= IBV_WC_EX_SEED_WITH_COMPLETION_TIMESTAMP_WALLCLOCK;
	return f;
}

/* The seed's helpers (patch 5/8), with its formulas: offsets are from wc_ex->buffer. */

static inline size_t ibv_wc_ex_get_offsetof64(uint64_t cq_creation_wc_flags,
					      enum ibv_wc_flags_ex flag)
{
	return __builtin_popcountll(cq_creation_wc_flags &
				    IBV_WC_EX_SEED_WITH_64BIT_FIELDS &
				    (flag - 1)) * sizeof(uint64_t);
}

static inline size_t ibv_wc_ex_get_offsetof32(uint64_t cq_creation_wc_flags,
					      enum ibv_wc_flags_ex flag)
{
	return __builtin_popcountll(cq_creation_wc_flags &
				    (IBV_WC_EX_SEED_WITH_64BIT_FIELDS)) *
		sizeof(uint64_t) +
		__builtin_popcountll(cq_creation_wc_flags &
				     IBV_WC_EX_SEED_WITH_32BIT_FIELDS &
				     (flag - 1)) * sizeof(uint32_t);
}

static inline size_t ibv_wc_ex_get_offsetof16(uint64_t cq_creation_wc_flags,
					      enum ibv_wc_flags_ex flag)
{
	return __builtin_popcountll(cq_creation_wc_flags &
				    (IBV_WC_EX_SEED_WITH_64BIT_FIELDS)) *
		sizeof(uint64_t) +
		__builtin_popcountll(cq_creation_wc_flags &
				     (IBV_WC_EX_SEED_WITH_32BIT_FIELDS)) *
		sizeof(uint32_t) +
		__builtin_popcountll(cq_creation_wc_flags &
				     IBV_WC_EX_SEED_WITH_16BIT_FIELDS &
				     (flag - 1)) * sizeof(uint16_t);
}

static inline size_t ibv_wc_ex_get_offsetof8(uint64_t cq_creation_wc_flags,
					     enum ibv_wc_flags_ex flag)
{
	return __builtin_popcountll(cq_creation_wc_flags &
				    (IBV_WC_EX_SEED_WITH_64BIT_FIELDS)) *
		sizeof(uint64_t) +
		__builtin_popcountll(cq_creation_wc_flags &
				     (IBV_WC_EX_SEED_WITH_32BIT_FIELDS)) *
		sizeof(uint32_t) +
		__builtin_popcountll(cq_creation_wc_flags &
				     (IBV_WC_EX_SEED_WITH_16BIT_FIELDS)) *
		sizeof(uint16_t) +
		__builtin_popcountll(cq_creation_wc_flags &
				     IBV_WC_EX_SEED_WITH_8BIT_FIELDS &
				     (flag - 1)) * sizeof(uint8_t);
}

static inline uint64_t ibv_wc_ex_get64(const struct ibv_wc_ex *wc_ex,
				       uint64_t cq_creation_wc_flags,
				       enum ibv_wc_flags_ex flag)
{
	const uint64_t *pdata = (const uint64_t *)(wc_ex->buffer +
			ibv_wc_ex_get_offsetof64(cq_creation_wc_flags, flag));

	return *pdata;
}

static inline uint32_t ibv_wc_ex_get32(const struct ibv_wc_ex *wc_ex,
				       uint64_t cq_creation_wc_flags,
				       enum ibv_wc_flags_ex flag)
{
	const uint32_t *pdata = (const uint32_t *)(wc_ex->buffer +
			ibv_wc_ex_get_offsetof32(cq_creation_wc_flags, flag));

	return *pdata;
}

static inline uint16_t ibv_wc_ex_get16(const struct ibv_wc_ex *wc_ex,
				       uint64_t cq_creation_wc_flags,
				       enum ibv_wc_flags_ex flag)
{
	const uint16_t *pdata = (const uint16_t *)(wc_ex->buffer +
			ibv_wc_ex_get_offsetof16(cq_creation_wc_flags, flag));

	return *pdata;
}

static inline uint8_t ibv_wc_ex_get8(const struct ibv_wc_ex *wc_ex,
				     uint64_t cq_creation_wc_flags,
				     enum ibv_wc_flags_ex flag)
{
	const uint8_t *pdata = (const uint8_t *)(wc_ex->buffer +
			ibv_wc_ex_get_offsetof8(cq_creation_wc_flags, flag));

	return *pdata;
}

/* Bytes of one record, header included. */
static inline size_t ibv_wc_ex_get_size(uint64_t flags)
{
	return ((__builtin_popcountll(flags & IBV_WC_EX_SEED_WITH_64BIT_FIELDS) *
		 sizeof(uint64_t) +
		 __builtin_popcountll(flags & IBV_WC_EX_SEED_WITH_32BIT_FIELDS) *
		 sizeof(uint32_t) +
		 __builtin_popcountll(flags & IBV_WC_EX_SEED_WITH_16BIT_FIELDS) *
		 sizeof(uint16_t) +
		 __builtin_popcountll(flags & IBV_WC_EX_SEED_WITH_8BIT_FIELDS) *
		 sizeof(uint8_t) + (sizeof(uint64_t) - 1)) &
		~(sizeof(uint64_t) - 1)) + sizeof(struct ibv_wc_ex);
}

#ifdef __cplusplus
}
#endif

#endif /* SOFTVERBS_VERBS_EXT_H */
