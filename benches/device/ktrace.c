/* CUPTI injection library (CUDA_INJECTION64_PATH): records every kernel's
 * start/end (GPU ns) and name, tab-separated, to $KTRACE_OUT. */
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#define BUF_BYTES (16u << 20)
static FILE *out;
static void CUPTIAPI req(uint8_t **buf, size_t *size, size_t *max) {
  *buf = (uint8_t *)aligned_alloc(8, BUF_BYTES); *size = BUF_BYTES; *max = 0;
}
static void CUPTIAPI done(CUcontext c, uint32_t s, uint8_t *buf, size_t size, size_t valid) {
  CUpti_Activity *r = NULL;
  while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
    if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || r->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      KREC *k = (KREC *)r;
      fprintf(out, "K\t%llu\t%llu\t%u\t%s\n", (unsigned long long)k->start, (unsigned long long)k->end, k->streamId, k->name);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      CUpti_ActivityMemcpy6 *m = (CUpti_ActivityMemcpy6 *)r;
      fprintf(out, "M\t%llu\t%llu\t%u\tmemcpy%d_%llu\n", (unsigned long long)m->start, (unsigned long long)m->end, m->streamId, (int)m->copyKind, (unsigned long long)m->bytes);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      CUpti_ActivityMemset4 *m = (CUpti_ActivityMemset4 *)r;
      fprintf(out, "S\t%llu\t%llu\t%u\tmemset_%llu\n", (unsigned long long)m->start, (unsigned long long)m->end, m->streamId, (unsigned long long)m->bytes);
    }
  }
  free(buf);
}
static void fini(void) { cuptiActivityFlushAll(1); if (out) fclose(out); out = NULL; }
int InitializeInjection(void) {
  const char *p = getenv("KTRACE_OUT");
  out = fopen(p ? p : "/tmp/ktrace.tsv", "w");
  if (!out) return 0;
  cuptiActivityRegisterCallbacks(req, done);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
  atexit(fini);
  return 1;
}
