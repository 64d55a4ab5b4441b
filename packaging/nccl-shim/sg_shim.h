/*
 * spotguard NCCL shim: what the generated wrappers (sg_wrappers.c, written by gen_wrappers.py
 * from the nccl.h the shim is built against) need from the hand-written core (sg_shim.c).
 *
 * Every wrapped call goes through sg_begin / sg_end: sg_begin translates the application's
 * handle (a struct sg_comm of ours) to NCCL's real communicator, notes a CUDA stream that is
 * being captured into a graph, waits at the gate while spotguard holds NCCL closed (a
 * checkpoint is releasing or has released the communicators) and counts the operation; sg_end
 * leaves the gate. Handles that are not ours pass through untouched.
 */
#ifndef SG_SHIM_H
#define SG_SHIM_H

#include "sg_nccl_api.h"

/* what kind of operation a call is (how the gate counts it) */
enum sg_kind {
  SG_NONE = 0, /* a call that needs a live communicator but issues no operation */
  SG_COLL = 1, /* an operation every member of the communicator issues */
  SG_SEND = 2, /* a point-to-point send to `peer` */
  SG_RECV = 3  /* a point-to-point receive from `peer` */
};

typedef struct sg_call {
  struct sg_comm *c;  /* our handle, or NULL for a handle that is not ours */
  void *real;         /* the communicator to hand to NCCL */
  int entered;        /* whether sg_begin passed the gate (sg_end leaves it) */
} sg_call;

/* Resolve NCCL's own `name` (the real library, never this one), cached in *slot. */
void *sg_resolve(void **slot, const char *name);

/* 0: call NCCL with call->real; else return the ncclResult_t it gives (no live communicator). */
int sg_begin(sg_call *call, void *handle, enum sg_kind kind, int peer, const void *stream);
void sg_end(sg_call *call);

#endif
