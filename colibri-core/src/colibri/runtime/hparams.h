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

/* Add one `--set` argument, "key=value" (NULL: the flag had no value): 0, or -1 with a message. */
int cb_hp_add(cb_hparams *hp, const char *arg, char *err, size_t errlen);
/* Every key some block read (cb_hp_*): 0, or -1 with a message naming the first key nobody asked for. */
int cb_hp_check_used(const cb_hparams *hp, const char *engine, char *err, size_t errlen);
/* Free the table's keys and values (the table itself is the caller's). */
void cb_hp_free(cb_hparams *hp);

/* Each getter returns 0 and fills *out; a missing required key or an unparsable value is -1 with a message
 * naming the key. The _opt variants leave *out (the default) alone when the key is absent. */
int cb_hp_int(cb_hparams *hp, const char *key, int *out, char *err, size_t errlen);
int cb_hp_int_opt(cb_hparams *hp, const char *key, int *out, char *err, size_t errlen);
int cb_hp_float(cb_hparams *hp, const char *key, float *out, char *err, size_t errlen);
int cb_hp_float_opt(cb_hparams *hp, const char *key, float *out, char *err, size_t errlen);
int cb_hp_bool_opt(cb_hparams *hp, const char *key, int *out, char *err, size_t errlen);
/* Returns the value string (owned by hp) or def when absent. */
const char *cb_hp_str_opt(cb_hparams *hp, const char *key, const char *def);

/* ---- declarative tables: a block or a family names its keys once, with where each lands ---- */

typedef enum {
    CB_HP_INT,                 /* required integer */
    CB_HP_INT_OPT,             /* integer, `def` when absent */
    CB_HP_FLOAT,               /* required number */
    CB_HP_FLOAT_OPT,           /* number, `def` when absent */
    CB_HP_BOOL,                /* true/false/1/0, `def` when absent */
    CB_HP_STR,                 /* a string (owned by the cb_hparams), `text` when absent */
    CB_HP_LETTERS,             /* required: exactly one letter per layer from `text` (the int at len_offset) */
    CB_HP_CHOICE,              /* one of the comma-separated words of `text`, as its index (an int); `def` absent */
} cb_hp_type;

enum { CB_HP_ANY = 0, CB_HP_POSITIVE = 1, CB_HP_NONNEG = 2 };

typedef struct {
    const char *key;           /* NULL ends a table */
    cb_hp_type type;
    size_t offset;             /* of the int / float / const char * it fills, in the struct given to cb_hp_read */
    double def;
    int check;                 /* CB_HP_POSITIVE: an int >= 1 / a float > 0; CB_HP_NONNEG: >= 0 */
    const char *text;
    size_t len_offset;
} cb_hp_spec;

/* Required positive integer, optional integer / number with a default (and a check), flag, string, layer letters. */
#define CB_HP_REQ(key, T, f) {key, CB_HP_INT, offsetof(T, f), 0, CB_HP_POSITIVE, NULL, 0}
#define CB_HP_OPT(key, T, f, def, check) {key, CB_HP_INT_OPT, offsetof(T, f), def, check, NULL, 0}
#define CB_HP_NUM(key, T, f, def, check) {key, CB_HP_FLOAT_OPT, offsetof(T, f), def, check, NULL, 0}
#define CB_HP_FLAG(key, T, f, def) {key, CB_HP_BOOL, offsetof(T, f), def, CB_HP_ANY, NULL, 0}
#define CB_HP_TEXT(key, T, f, def) {key, CB_HP_STR, offsetof(T, f), 0, CB_HP_ANY, def, 0}
#define CB_HP_PER_LAYER(key, T, f, letters, n_field) \
    {key, CB_HP_LETTERS, offsetof(T, f), 0, CB_HP_ANY, letters, offsetof(T, n_field)}
#define CB_HP_CHOICE_OF(key, T, f, words, def) {key, CB_HP_CHOICE, offsetof(T, f), def, CB_HP_ANY, words, 0}
#define CB_HP_END {NULL, CB_HP_INT, 0, 0, CB_HP_ANY, NULL, 0}

/* ---- per-layer lists in a config's own spellings, as one letter per layer ---- */

/* value: one comma-separated word per layer (a config's layer_types, e.g. "full_attention,linear_attention");
 * words: each accepted word and its letter ("full_attention=F,linear_attention=L"). out[0..n) = the letters, NUL
 * after them (out holds n + 1). 0, or -1 with a message naming --set key and the entry. */
int cb_hp_layer_words(const char *key, const char *value, const char *words, int n, char *out, char *err,
                      size_t errlen);
/* value: comma-separated layer indices below n (a config's mlp_only_layers; "" none): out[l] = letter for each. */
int cb_hp_layer_indices(const char *key, const char *value, int n, char letter, char *out, char *err, size_t errlen);

/* Fill dst from hp as the table says, in table order (a letters key's length field must come before it): 0, or -1
 * with a message naming the key and what it must be. */
int cb_hp_read(cb_hparams *hp, const cb_hp_spec *table, void *dst, char *err, size_t errlen);

#endif
