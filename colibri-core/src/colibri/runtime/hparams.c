/* hparams.c: the --set key=value hyperparameters (see hparams.h). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hparams.h"

static int find(cb_hparams *hp, const char *key) {
    for (int i = hp->n - 1; i >= 0; i--)      /* the last --set of a key wins */
        if (strcmp(hp->keys[i], key) == 0) return i;
    return -1;
}

static void mark_used(cb_hparams *hp, const char *key) {
    for (int i = 0; i < hp->n; i++)
        if (strcmp(hp->keys[i], key) == 0) hp->used[i] = 1;
}

/* 1 with *v the value of key (marked used); 0 when it is absent and optional; -1 with a message naming the key and
 * the `what` it takes when it is absent and required. */
static int take(cb_hparams *hp, const char *key, int required, const char *what, const char **v, char *err,
                size_t errlen) {
    int i = find(hp, key);
    if (i < 0) {
        if (!required) return 0;
        snprintf(err, errlen, "missing --set %s=<%s> (the family plugin resolves it from config.json)", key, what);
        return -1;
    }
    mark_used(hp, key);
    *v = hp->values[i];
    return 1;
}

const char *cb_hp_str_opt(cb_hparams *hp, const char *key, const char *def) {
    const char *v = def;
    take(hp, key, 0, "text", &v, NULL, 0);
    return v;
}

/* One number parser for both kinds: 1 with *out read, 0 when an optional key is absent, -1 with a message. */
static int get_number(cb_hparams *hp, const char *key, int integer, int required, double *out, char *err,
                      size_t errlen) {
    const char *s;
    int rc = take(hp, key, required, integer ? "integer" : "number", &s, err, errlen);
    if (rc <= 0) return rc;
    char *end;
    errno = 0;
    double v = integer ? (double)strtol(s, &end, 10) : strtod(s, &end);
    if (errno || end == s || *end || (integer ? v < -2147483647.0 || v > 2147483647.0 : !isfinite(v))) {
        snprintf(err, errlen, "--set %s=%s: %s", key, s, integer ? "not an integer" : "not a finite number");
        return -1;
    }
    *out = v;
    return 1;
}

static int get_int(cb_hparams *hp, const char *key, int *out, int required, char *err, size_t errlen) {
    double v;
    int rc = get_number(hp, key, 1, required, &v, err, errlen);
    if (rc > 0) *out = (int)v;
    return rc < 0 ? -1 : 0;
}

static int get_float(cb_hparams *hp, const char *key, float *out, int required, char *err, size_t errlen) {
    double v;
    int rc = get_number(hp, key, 0, required, &v, err, errlen);
    if (rc > 0) *out = (float)v;
    return rc < 0 ? -1 : 0;
}

int cb_hp_int(cb_hparams *hp, const char *key, int *out, char *err, size_t errlen) {
    return get_int(hp, key, out, 1, err, errlen);
}
int cb_hp_int_opt(cb_hparams *hp, const char *key, int *out, char *err, size_t errlen) {
    return get_int(hp, key, out, 0, err, errlen);
}
int cb_hp_float(cb_hparams *hp, const char *key, float *out, char *err, size_t errlen) {
    return get_float(hp, key, out, 1, err, errlen);
}
int cb_hp_float_opt(cb_hparams *hp, const char *key, float *out, char *err, size_t errlen) {
    return get_float(hp, key, out, 0, err, errlen);
}

int cb_hp_bool_opt(cb_hparams *hp, const char *key, int *out, char *err, size_t errlen) {
    const char *v;
    if (take(hp, key, 0, "boolean", &v, err, errlen) <= 0) return 0;
    if (!strcmp(v, "1") || !strcmp(v, "true") || !strcmp(v, "True")) *out = 1;
    else if (!strcmp(v, "0") || !strcmp(v, "false") || !strcmp(v, "False")) *out = 0;
    else {
        snprintf(err, errlen, "--set %s=%s: not a boolean (true/false/1/0)", key, v);
        return -1;
    }
    return 0;
}

static int check_range(const cb_hp_spec *s, double v, char *err, size_t errlen) {
    int int_kind = s->type == CB_HP_INT || s->type == CB_HP_INT_OPT;
    if (s->check == CB_HP_POSITIVE && (int_kind ? v < 1 : !(v > 0))) {
        snprintf(err, errlen, "--set %s=%g out of range (must be positive)", s->key, v);
        return -1;
    }
    if (s->check == CB_HP_NONNEG && v < 0) {
        snprintf(err, errlen, "--set %s=%g out of range (must not be negative)", s->key, v);
        return -1;
    }
    return 0;
}

int cb_hp_read(cb_hparams *hp, const cb_hp_spec *table, void *dst, char *err, size_t errlen) {
    char *base = dst;
    for (const cb_hp_spec *s = table; s->key; s++) {
        void *at = base + s->offset;
        switch (s->type) {
        case CB_HP_INT:
        case CB_HP_INT_OPT:
            if (s->type == CB_HP_INT_OPT) *(int *)at = (int)s->def;
            if (get_int(hp, s->key, at, s->type == CB_HP_INT, err, errlen) || check_range(s, *(int *)at, err, errlen))
                return -1;
            break;
        case CB_HP_FLOAT:
        case CB_HP_FLOAT_OPT:
            if (s->type == CB_HP_FLOAT_OPT) *(float *)at = (float)s->def;
            if (get_float(hp, s->key, at, s->type == CB_HP_FLOAT, err, errlen) ||
                check_range(s, *(float *)at, err, errlen))
                return -1;
            break;
        case CB_HP_BOOL:
            *(int *)at = (int)s->def;
            if (cb_hp_bool_opt(hp, s->key, at, err, errlen)) return -1;
            break;
        case CB_HP_STR:
            *(const char **)at = cb_hp_str_opt(hp, s->key, s->text);
            break;
        case CB_HP_CHOICE: {
            const char *v = cb_hp_str_opt(hp, s->key, NULL);
            *(int *)at = (int)s->def;
            if (!v) break;
            int i = 0;
            const char *w = s->text;
            for (size_t len = strlen(v); *w; i++) {
                const char *end = strchr(w, ',');
                size_t wl = end ? (size_t)(end - w) : strlen(w);
                if (wl == len && !strncmp(w, v, len)) break;
                w = end ? end + 1 : w + wl;
            }
            if (!*w) {
                snprintf(err, errlen, "--set %s=%s: expected one of %s", s->key, v, s->text);
                return -1;
            }
            *(int *)at = i;
            break;
        }
        case CB_HP_LETTERS: {
            int n = *(const int *)(base + s->len_offset);
            const char *v = cb_hp_str_opt(hp, s->key, NULL);
            if (!v || (int)strlen(v) != n || strspn(v, s->text) != strlen(v)) {
                snprintf(err, errlen, "--set %s: needs exactly %d letters from %s, one per layer", s->key, n, s->text);
                return -1;
            }
            *(const char **)at = v;
            break;
        }
        }
    }
    return 0;
}

/* The letter of the word value[0..len) in words ("word=L,word=L"), or 0. */
static char letter_of(const char *words, const char *value, size_t len) {
    for (const char *w = words; *w;) {
        const char *eq = strchr(w, '='), *end = strchr(w, ',');
        if (!eq) return 0;
        if ((size_t)(eq - w) == len && !strncmp(w, value, len)) return eq[1];
        if (!end) return 0;
        w = end + 1;
    }
    return 0;
}

int cb_hp_layer_words(const char *key, const char *value, const char *words, int n, char *out, char *err,
                      size_t errlen) {
    const char *s = value;
    for (int l = 0; l < n; l++) {
        const char *end = strchr(s, ',');
        size_t len = end ? (size_t)(end - s) : strlen(s);
        if (!(out[l] = letter_of(words, s, len))) {
            char accepted[256];
            size_t k = 0;
            for (const char *w = words; *w && k + 2 < sizeof accepted; w++)
                if (*w == '=') w++;                 /* skip the letter */
                else accepted[k++] = *w == ',' ? ' ' : *w;
            accepted[k] = 0;
            snprintf(err, errlen, "--set %s: entry %d is %.*s, expected one of: %s", key, l, (int)len, s, accepted);
            return -1;
        }
        if (!end && l + 1 < n) {
            snprintf(err, errlen, "--set %s: %d entries for %d layers", key, l + 1, n);
            return -1;
        }
        s = end ? end + 1 : s + len;
    }
    if (*s || (s > value && s[-1] == ',')) {
        snprintf(err, errlen, "--set %s: more entries than the %d layers", key, n);
        return -1;
    }
    out[n] = 0;
    return 0;
}

int cb_hp_layer_indices(const char *key, const char *value, int n, char letter, char *out, char *err, size_t errlen) {
    for (const char *s = value; *s;) {
        char *end;
        long l = strtol(s, &end, 10);
        if (end == s || l < 0 || l >= n || (*end && *end != ',')) {
            snprintf(err, errlen, "--set %s: expected comma-separated layer indices below %d", key, n);
            return -1;
        }
        out[l] = letter;
        s = *end ? end + 1 : end;
    }
    return 0;
}

int cb_hp_add(cb_hparams *hp, const char *arg, char *err, size_t errlen) {
    const char *eq = arg ? strchr(arg, '=') : NULL;
    if (!eq || eq == arg) {
        snprintf(err, errlen, "--set needs key=value, got %s", arg ? arg : "nothing");
        return -1;
    }
    char **k = realloc(hp->keys, (size_t)(hp->n + 1) * sizeof *k);
    if (k) hp->keys = k;
    char **vv = realloc(hp->values, (size_t)(hp->n + 1) * sizeof *vv);
    if (vv) hp->values = vv;
    int *u = realloc(hp->used, (size_t)(hp->n + 1) * sizeof *u);
    if (u) hp->used = u;
    if (!k || !vv || !u) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    hp->keys[hp->n] = strndup(arg, (size_t)(eq - arg));
    hp->values[hp->n] = strdup(eq + 1);
    hp->used[hp->n] = 0;
    hp->n++;
    if (!hp->keys[hp->n - 1] || !hp->values[hp->n - 1]) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    return 0;
}

int cb_hp_check_used(const cb_hparams *hp, const char *engine, char *err, size_t errlen) {
    for (int i = 0; i < hp->n; i++)
        if (!hp->used[i]) {
            snprintf(err, errlen, "--set %s: not a hyperparameter of the %s engine", hp->keys[i], engine);
            return -1;
        }
    return 0;
}

void cb_hp_free(cb_hparams *hp) {
    for (int i = 0; i < hp->n; i++) {
        free(hp->keys[i]);
        free(hp->values[i]);
    }
    free(hp->keys);
    free(hp->values);
    free(hp->used);
}
