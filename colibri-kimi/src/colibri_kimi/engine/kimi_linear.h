/* kimi_linear.h: the Kimi Linear family (kimi_linear.c), which kimi.c's engine runs for model_type kimi_linear. */
#ifndef COLIBRI_KIMI_LINEAR_H
#define COLIBRI_KIMI_LINEAR_H

#include "family.h"

extern const cb_family cb_kimi_linear_family;

#endif
