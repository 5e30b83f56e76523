/* The version of the runtime's C API: what a family engine compiles against (engine.h, blocks.h and the block
 * headers they include). Bump it when a change to those headers would break a family engine written against the
 * previous version; a family states the version it builds against (EngineSource.runtime_api) and core's builder
 * refuses a mismatch with one line before compiling, instead of a page of compiler errors. */
#ifndef COLIBRI_RUNTIME_API_H
#define COLIBRI_RUNTIME_API_H

#define CB_RUNTIME_API 1

#endif
