/* hparams.h: the hyperparameters an engine is given as --set key=value (resolved from config.json by the family
 * plugin). A runtime block reads its own keys from here; the process (engine.c) only fills the table.
 */
#ifndef COLIBRI_HPARAMS_H
#define COLIBRI_HPARAMS_H

#include <stddef.h>

typedef struct {
    int n;
    char **keys, **values;
    int *used;                 /* a key nobody asked for is refused after load: a typo must not pass silently */
} cb_hparams;

/* Each getter returns 0 and fills *out; a missing required key or an unparsable value is -1 with a message
 * naming the key. The _opt variants leave *out (the default) alone when the key is absent. */
int cb_hp_int(cb_hparams *hp, const char *key, int *out, char *err, size_t errlen);
int cb_hp_int_opt(cb_hparams *hp, const char *key, int *out, char *err, size_t errlen);
int cb_hp_float(cb_hparams *hp, const char *key, float *out, char *err, size_t errlen);
int cb_hp_float_opt(cb_hparams *hp, const char *key, float *out, char *err, size_t errlen);
int cb_hp_bool_opt(cb_hparams *hp, const char *key, int *out, char *err, size_t errlen);
/* Returns the value string (owned by hp) or def when absent. */
const char *cb_hp_str_opt(cb_hparams *hp, const char *key, const char *def);

#endif
