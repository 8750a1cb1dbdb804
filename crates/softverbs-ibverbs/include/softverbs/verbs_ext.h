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
 * The non-contiguous memory regions of seed 002 ("[RFC rdma-core 2/2] verbs: Introduce
 * non-contiguous memory registration" and its replies) are in the second half of this header:
 * ibv_mr_set_layout_sg, ibv_mr_set_layout_interleaved, their structs, flags and result codes,
 * and ibv_query_mr_layout_caps; and the page-list and bitmap registrations its replies ask
 * for, ibv_reg_mr_pages and ibv_reg_mr_bitmap.
 *
 * Linking: ibv_poll_cq_ex, ibv_wc_ex_cq_flags, ibv_mr_set_layout_sg,
 * ibv_mr_set_layout_interleaved, ibv_query_mr_layout_caps, ibv_reg_mr_pages and
 * ibv_reg_mr_bitmap are exported by the softverbs
 * libibverbs.so.1 only (symbol version SOFTVERBS_1.0), so link against it, e.g.
 *   cc -I<softverbs>/crates/softverbs-ibverbs/include prog.c -L<dir> -libverbs
 * where <dir>/libibverbs.so is the softverbs library (target/<profile>/libibverbs.so), and run
 * the program with `softverbs run -- prog` (or LD_LIBRARY_PATH pointing there).
 */
#ifndef SOFTVERBS_VERBS_EXT_H
#define SOFTVERBS_VERBS_EXT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <infiniband/verbs.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Feature test: this header's interface version (2: non-contiguous memory regions). */
#define SOFTVERBS_VERBS_EXT 2

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

/* ---- Non-contiguous memory regions (seed 002) ------------------------------------------
 *
 * A layout container is a zero-length, zero-based MR, made as in the seed's examples:
 *	container = ibv_reg_mr(pd, NULL, 0, IBV_ACCESS_ZERO_BASED | <rights>);
 * (softverbs turns every zero-length IBV_ACCESS_ZERO_BASED registration into a container; the
 * address is ignored). <rights> are the rights every access through the container needs, on
 * top of the rights of the regions its layout uses, and the rights plain buffers of
 * IBV_MR_SET_LAYOUT_REGISTER_BUFFERS layouts get. ibv_mr_set_layout_sg() or
 * ibv_mr_set_layout_interleaved() then gives it a layout; each call replaces the previous
 * layout. The container's key works wherever a key does, with IOVAs 0 .. length - 1: as the
 * lkey of SEND/RECV/WRITE/READ SGEs and as the rkey of RDMA WRITE/READ (and of atomics where
 * the datum is 8-byte aligned), every piece checked for bounds and rights in its own region.
 *
 * The C struct ibv_mr of a container is kept up to date by the two calls: lkey, rkey (and
 * handle) are the container's current key, length the length of the layout last set (with
 * IBV_MR_SET_LAYOUT_WITH_POST_WR: the staged layout's, in force once its bind work request
 * has executed). Re-read mr->lkey / mr->rkey after every call: see "Keys" below.
 *
 * Results: 0, or one of enum ibv_mr_set_layout_err_code below, with errno set:
 *	IBV_MR_SET_LAYOUT_ERR_INPUT (-1), errno EINVAL: malformed input (NULL or unknown mr, not
 *	a container, a NULL list, negative counts, a key that is not a region of the container's
 *	PD, a datum outside its region, the container naming itself, zero lengths or counts
 *	...). errno ENOMEM (or another OS errno) with -1: the device ran out of resources, a
 *	failure the seed has no code for. Either way the old layout is still in force.
 *	IBV_MR_SET_LAYOUT_ERR_WOULD_INVALIDATE (-2), errno EBUSY: the layout needs a key change
 *	and IBV_MR_SET_LAYOUT_AVOID_INVALIDATION was given; the old layout (and key) is intact.
 *	IBV_MR_SET_LAYOUT_ERR_UNSUPPORTED (-3), errno EOPNOTSUPP: valid input beyond the caps
 *	(more SGEs, entries or dimensions than struct ibv_mr_layout_caps allows, nesting deeper
 *	than max_mr_nesting_level, a layout longer than max_mr_size, unknown flag bits); the old
 *	layout is intact.
 *
 * Keys. A layout of up to max_inline_num_sg SGEs (max_inline_num_interleaved entries), or no
 * larger than the largest the container had before, keeps the container's key; a larger one
 * needs more room in the key entry, so the container gets a new key and the old lkey/rkey stop
 * working at once (peers holding the old rkey get remote access errors). With
 * IBV_MR_SET_LAYOUT_AVOID_INVALIDATION the call fails with ..._WOULD_INVALIDATE instead.
 * num_repeated and datum_count never need room (softverbs stores the pattern, not its
 * expansion).
 *
 * IBV_MR_SET_LAYOUT_WITH_POST_WR. The layout is staged, and takes effect when a bind work
 * request for the container executes on a QP of the container's PD; work requests posted
 * after it on that QP already see it. softverbs' form of the seed's IBV_WR_BIND_MR is the
 * provider's own opcode, IBV_WR_DRIVER1, with the container where the seed's
 * wr->mr_set_layout.mr lies (the shipped header's wr->bind_mw.mw, the same bytes): fill it
 * with ibv_wr_bind_mr() below and post it with ibv_post_send(). It takes no SGEs and completes
 * with opcode IBV_WC_BIND_MW (IBV_WC_MW_BIND_ERR when nothing is staged or the QP has another
 * PD). ibv_post_send() fails with EINVAL for an IBV_WR_BIND_MR naming anything but a live
 * container. IBV_WR_BIND_MW is the memory-window bind of verbs.h (ibv_alloc_mw), unrelated to
 * layouts. The ibv_qp_ex (ibv_wr_*) interface has no bind for layouts.
 *
 * Deregistration. ibv_dereg_mr() of a region a layout uses (as a datum, or nested) fails with
 * EBUSY and leaves it registered: deregister (or re-lay-out) the container first, "in inverse
 * order relative to registration" as the seed says.
 *
 * Caps. The seed puts struct ibv_mr_layout_caps into struct ibv_device_attr_ex after
 * cq_mod_caps; the shipped struct has other fields there (max_dm_size, pci_atomic_caps, ...)
 * and ibv_query_device_ex copies it by size, so there is no room for it without breaking the
 * ABI. softverbs reports the caps through its own call, ibv_query_mr_layout_caps().
 *
 * Not in C: the page-list and bitmap registrations of the reply thread (cap flags
 * IBV_MR_SET_LAYOUT_PAGE_LIST / _PAGE_BITMAP) are Rust-only (ProtectionDomain::reg_mr_pages /
 * reg_mr_bitmap in the softverbs crate).
 */

/* The seed's enum ibv_mr_layout_cap_flags (bits 0..4), plus the reply thread's. */
enum ibv_mr_layout_cap_flags {
	IBV_MR_SET_LAYOUT_SG					= 1 << 0,
	IBV_MR_SET_LAYOUT_INTERLEAVED				= 1 << 1,
	/* num_repeated > 1 */
	IBV_MR_SET_LAYOUT_INTERLEAVED_REPEAT			= 1 << 2,
	/* num_repeated differing between entries */
	IBV_MR_SET_LAYOUT_INTERLEAVED_NONUNIFORM_REPEAT	= 1 << 3,
	/* entries lasting different numbers of round-robin cycles */
	IBV_MR_SET_LAYOUT_INTERLEAVED_NONUNIFORM_DATUM_TOTAL	= 1 << 4,
	/* IBV_MR_SET_LAYOUT_REGISTER_BUFFERS is accepted */
	IBV_MR_SET_LAYOUT_INTERNAL_REGISTRATION		= 1 << 5,
	/* page-list / bitmap registrations (Rust API only) */
	IBV_MR_SET_LAYOUT_PAGE_LIST				= 1 << 6,
	IBV_MR_SET_LAYOUT_PAGE_BITMAP				= 1 << 7,
};

/* The seed's struct ibv_mr_layout_caps (32 bytes). */
struct ibv_mr_layout_caps {
	uint64_t cap_flags;			/* enum ibv_mr_layout_cap_flags */
	uint32_t max_num_sg;			/* SGEs of one SG layout */
	uint32_t max_inline_num_sg;		/* SG layouts this small never change the key */
	uint32_t max_num_interleaved;		/* entries of one interleaved layout */
	uint32_t max_inline_num_interleaved;	/* interleaved layouts this small keep the key */
	union {
		uint32_t max_mr_stride_dimenson;	/* the seed's spelling */
		uint32_t max_mr_stride_dimension;	/* dimensions per interleaved entry */
	};
	uint32_t max_mr_nesting_level;		/* a layout over plain MRs is level 1 */
};

/* The seed's enum ibv_mr_set_layout_flags, plus the reply thread's REGISTER_BUFFERS. */
enum ibv_mr_set_layout_flags {
	/* The layout takes effect at a bind work request (see above). */
	IBV_MR_SET_LAYOUT_WITH_POST_WR		= 1 << 0,
	/* Fail with IBV_MR_SET_LAYOUT_ERR_WOULD_INVALIDATE rather than change the keys. */
	IBV_MR_SET_LAYOUT_AVOID_INVALIDATION	= 1 << 1,
	/* SGEs (first data) with lkey 0 are plain buffers of this process, registered inside the
	 * call with the container's rights (addr is a pointer); they must stay valid while the
	 * layout is in force. Needs IBV_MR_SET_LAYOUT_INTERNAL_REGISTRATION. */
	IBV_MR_SET_LAYOUT_REGISTER_BUFFERS	= 1 << 2,
	IBV_MR_SET_LAYOUT_FLAGS_SUPPORTED	= (IBV_MR_SET_LAYOUT_REGISTER_BUFFERS << 1) - 1
};

/* The seed's struct ibv_mr_layout_interleved_dimensions (spelled as the seed spells it; the
 * man page's struct ibv_mr_interleved_dimensions and the correctly spelled
 * ibv_mr_layout_interleaved_dimensions name the same struct). */
struct ibv_mr_layout_interleved_dimensions {
	uint64_t offset_stride;	/* distance between the starts of two consecutive items */
	uint64_t datum_count;	/* number of items in this dimension */
};
#define ibv_mr_interleved_dimensions ibv_mr_layout_interleved_dimensions
#define ibv_mr_layout_interleaved_dimensions ibv_mr_layout_interleved_dimensions

/* The seed's struct ibv_mr_layout_interleaved (32 bytes; the man page's example calls it
 * struct ibv_mr_interleaved, which names the same struct). One entry of an interleaved
 * layout: data of first_datum.length bytes, the k-th of them (k counted in mixed radix over
 * the dimensions, dims[0] innermost) at first_datum.addr + sum(k_i * dims[i].offset_stride)
 * of region first_datum.lkey; each round-robin cycle takes num_repeated consecutive data from
 * each entry in list order, an exhausted entry drops out, and the layout ends when all are. */
struct ibv_mr_layout_interleaved {
	struct ibv_sge first_datum;
	int num_repeated;		/* at least 1 */
	union {
		int num_dimensions;	/* size of dims[], at least 1 */
		int num_dimentsions;	/* the seed header's spelling */
	};
	struct ibv_mr_layout_interleved_dimensions *dims;
};
#define ibv_mr_interleaved ibv_mr_layout_interleaved

/* The seed's enum ibv_mr_set_layout_err_code (see "Results" above for errno). */
enum ibv_mr_set_layout_err_code {
	/* Old MR is valid, invalid input */
	IBV_MR_SET_LAYOUT_ERR_INPUT = -1,
	/* MR requires invalidation, but IBV_MR_SET_LAYOUT_AVOID_INVALIDATION is on */
	IBV_MR_SET_LAYOUT_ERR_WOULD_INVALIDATE = -2,
	/* Input valid, but the capability is unsupported (see ibv_mr_layout_caps) */
	IBV_MR_SET_LAYOUT_ERR_UNSUPPORTED = -3,
};

/**
 * ibv_mr_set_layout_sg - Register several memory regions as one
 * @mr: a layout container of this library
 * @flags: enum ibv_mr_set_layout_flags
 * @num_sge: entries of @sg_list (at most max_num_sg)
 * @sg_list: the data, back to back: each names a region by lkey (a container nests) and a
 *           range in it (an address, or an offset for zero-based regions and containers)
 *
 * Returns 0 or an enum ibv_mr_set_layout_err_code value with errno set (see above).
 */
int ibv_mr_set_layout_sg(struct ibv_mr *mr, int flags, int num_sge, struct ibv_sge *sg_list);

/**
 * ibv_mr_set_layout_interleaved - Register several interleaving memory regions as one
 * @mr: a layout container of this library
 * @flags: enum ibv_mr_set_layout_flags
 * @num_interleaved: entries of @interleaved_list (at most max_num_interleaved)
 * @interleaved_list: the entries, taken round-robin
 *
 * Returns 0 or an enum ibv_mr_set_layout_err_code value with errno set (see above).
 */
int ibv_mr_set_layout_interleaved(struct ibv_mr *mr, int flags, int num_interleaved,
				  struct ibv_mr_layout_interleaved *interleaved_list);

/**
 * ibv_query_mr_layout_caps - The seed's mr_layout_caps of ibv_query_device_ex
 *
 * Returns 0, or EINVAL for a NULL or unknown @context or a NULL @caps.
 */
int ibv_query_mr_layout_caps(struct ibv_context *context, struct ibv_mr_layout_caps *caps);

/**
 * ibv_reg_mr_pages - Register a list of pages as one region
 * @pd: protection domain
 * @pages: @num_pages page addresses, each @page_size-aligned, in the region's order (they need
 *         not be contiguous or in order in memory; neighbours in memory are merged)
 * @page_size: a power of two
 * @first_offset: where in pages[0] the region starts
 * @length: bytes of the region, through the pages in order
 * @iova: the address SGEs and peers use for the region's first byte (0 with
 *        IBV_ACCESS_ZERO_BASED); mr->addr is this address
 * @access: enum ibv_access_flags
 *
 * The pages must stay valid until ibv_dereg_mr. Returns the region, or NULL with errno EINVAL
 * (NULL @pd or @pages, no pages, a misaligned page, @length past the last page, ...).
 */
struct ibv_mr *ibv_reg_mr_pages(struct ibv_pd *pd, void *const *pages, size_t num_pages,
				size_t page_size, size_t first_offset, size_t length,
				uint64_t iova, unsigned int access);

/**
 * ibv_reg_mr_bitmap - Register the pages of a range that a bitmap selects
 * @pd: protection domain
 * @base: a @page_size-aligned address; page i is base + i * page_size
 * @page_size: a power of two
 * @bitmap: page i is in the region when bit (i % 64) of bitmap[i / 64] is set (least
 *          significant first)
 * @num_words: words of @bitmap
 * @iova: the address SGEs and peers use for the region's first byte (0 with
 *        IBV_ACCESS_ZERO_BASED); mr->addr is this address
 * @access: enum ibv_access_flags
 *
 * The region is the selected pages in increasing order; they must stay valid until
 * ibv_dereg_mr. Returns the region, or NULL with errno EINVAL (NULL @pd or @bitmap, no page
 * selected, a misaligned @base, ...).
 */
struct ibv_mr *ibv_reg_mr_bitmap(struct ibv_pd *pd, void *base, size_t page_size,
				 const uint64_t *bitmap, size_t num_words, uint64_t iova,
				 unsigned int access);

/* The seed's IBV_WR_BIND_MR: softverbs' bind work request for WITH_POST_WR layouts (the
 * provider's own opcode, so IBV_WR_BIND_MW stays the memory-window bind). */
#define IBV_WR_BIND_MR IBV_WR_DRIVER1

/* Makes @wr the bind work request of container @mr (opcode, no SGEs, the container where the
 * seed's wr->mr_set_layout.mr lies); wr_id, send_flags and next are left to the caller. */
static inline void ibv_wr_bind_mr(struct ibv_send_wr *wr, struct ibv_mr *mr)
{
	wr->opcode = IBV_WR_BIND_MR;
	wr->sg_list = NULL;
	wr->num_sge = 0;
	memset(&wr->bind_mw, 0, sizeof(wr->bind_mw));
	wr->bind_mw.mw = (struct ibv_mw *)(void *)mr;
	wr->bind_mw.rkey = mr->rkey;
}

#ifdef __cplusplus
}
#endif

#endif /* SOFTVERBS_VERBS_EXT_H */
